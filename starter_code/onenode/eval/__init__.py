"""Evaluating a OneNode checkpoint (A2): lm-eval-harness tasks, held-out loss and perplexity.

```python
from onenode.eval import evaluate
report = evaluate("runs/tiny/final", suite="offline")       # the kit's own tasks, no hub needed
report = evaluate("runs/baseline/final", suite="standard")  # HellaSwag, ARC, PIQA, SciQ, WinoGrande, MMLU
report["tasks"]["onenode_order"]["acc"], report["heldout"]["loss"]
```
Two routes give the same numbers: `route="onenode"` (this kit's model as a registered lm-eval
model, `model=onenode`) and `route="hf"` (the transformers export through lm-eval's HFLM).
lm-eval (`pip install lm-eval`, the kit's `eval` extra) is imported only when a suite runs.
"""

from onenode.eval.run import evaluate

__all__ = ["evaluate"]
