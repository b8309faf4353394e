"""A1, a fast training stack: a patch to the starter, graded on the three slow paths it fixes."""
