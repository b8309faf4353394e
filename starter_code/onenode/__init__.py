"""OneNode: the student training stack for NemotronH."""
