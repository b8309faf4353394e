"""OneNode autograder (TA side). Never imported by student code."""
