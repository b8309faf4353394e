"""OneNode: the student training stack for NemotronH.

    import onenode
    model = onenode.load_pretrained("runs/tiny/final")   # NemotronHForCausalLM.from_pretrained
    model.save_pretrained("exported/")                   # transformers' layout and config.json
"""

from .model import NemotronHForCausalLM

__all__ = ["load_pretrained"]

load_pretrained = NemotronHForCausalLM.from_pretrained
