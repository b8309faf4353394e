"""A2's data pipeline: sources -> curation -> tokenizer -> shards -> mixture loader.

```python
from onenode.data import build, MixtureLoader
build("starter_code/onenode/data/configs/offline_default.yaml", "data/default")
loader = MixtureLoader("data/default", batch_size=8, seq_len=512, seed=0, rank=0, world_size=1)
input_ids, labels = next(loader)          # LongTensor [8, 512]; labels = next tokens
loader.state_dict(); loader.tokens_served; loader.order_digest
data_tokenizer("data/default").decode(input_ids[0].tolist())   # the folder's own tokenizer
```
Optional dependencies (tokenizers, tiktoken, transformers, datasets, pyarrow, py3langid) are
imported only where used, so `import onenode.data` needs none of them.
"""

from onenode.data.build import build, load_config
from onenode.data.loader import MixtureLoader
from onenode.data.tokenizer import Tokenizer, data_tokenizer, load_tokenizer

__all__ = ["MixtureLoader", "Tokenizer", "build", "data_tokenizer", "load_config", "load_tokenizer"]
