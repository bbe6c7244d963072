"""Configuration of Ladder Residual: a Llama config plus `ladder_layers`.

`ladder_layers` is either an int N (the LAST N layers are laddered, the paper's hybrid; 0 = plain
Llama, `num_hidden_layers` = fully laddered) or an explicit list of layer indices. The default, None,
is every layer (the paper's Ladder Transformer): it is resolved to `num_hidden_layers` when the config
is built, so a config.json always states the number, and a saved config.json (which always carries
`ladder_layers`: 0, 2, ...) loads with its own value. Weights and state-dict names are Llama's, so a
Llama checkpoint loads unchanged: `ZooLadderForCausalLM.from_pretrained(llama_dir, ladder_layers=N)`
(without `ladder_layers`: every layer laddered).
"""

from models.common.residual import check_ladder_layers, laddered_indices
from models.llama.configuration import ZooLlamaConfig


class ZooLadderConfig(ZooLlamaConfig):
    model_type = "zoo_ladder"
    residual_refusal = "Ladder is the dense Llama under the ladder schedule already: ladder_layers picks the laddered layers."

    # None (the default): every layer laddered, resolved to num_hidden_layers by `validate`.
    ladder_layers: int | list[int] | None = None

    def validate(self) -> None:
        # Runs at construction and again after from_pretrained's keyword overrides (see ZooLlamaConfig).
        super().validate()
        self.ladder_layers = check_ladder_layers(self.ladder_layers, self.num_hidden_layers)

    @property
    def laddered(self) -> frozenset[int]:
        """Indices of the laddered layers."""
        return laddered_indices(self.ladder_layers, self.num_hidden_layers)
