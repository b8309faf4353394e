"""nbgrader settings of the OneNode course.

This file is copied, with `source/`, into a course working folder (`onenode-grade release ...
--course DIR`); every nbgrader command runs there, so the course root, gradebook.db, release/,
submitted/, autograded/ and feedback/ all live in that folder, never in $HOME or in the kit.
"""

import os

c = get_config()  # noqa: F821 (provided by traitlets when nbgrader loads this file)

c.CourseDirectory.course_id = "onenode"
c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))  # the working folder
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(c.CourseDirectory.root, "gradebook.db")

# Cell timeouts: nbgrader's Execute reads its own trait; nbconvert's is set too, since older
# nbgrader versions read that one. The long measuring cells skip themselves while
# NBGRADER_EXECUTION is set, so every graded cell should finish in seconds.
c.Execute.timeout = 300
c.ExecutePreprocessor.timeout = 300

# A1 submissions hold the patch beside the notebook: autograde must not replace it.
c.Autograde.exclude_overwriting = {"a1": ["submission.patch"]}

# Feedback shows the graded notebook without the hidden tests' source (their pass/fail and
# the assertion message stay), so later cohorts meet the same hidden checks.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbgrader.preprocessors.ClearHiddenTests",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]
