"""Configuration of Ladder Residual: a Llama config plus `ladder_layers`.

`ladder_layers` is either an int N (the LAST N layers are laddered, the paper's hybrid; 0 = plain
Llama, `num_hidden_layers` = fully laddered) or an explicit list of layer indices. The default, None,
is every layer (the paper's Ladder Transformer): it is resolved to `num_hidden_layers` when the config
is built, so a config.json always states the number, and a saved config.json (which always carries
`ladder_layers`: 0, 2, ...) loads with its own value. Weights and state-dict names are Llama's, so a
Llama checkpoint loads unchanged: `ZooLadderForCausalLM.from_pretrained(llama_dir, ladder_layers=N)`
(without `ladder_layers`: every layer laddered).
"""

from models.llama.configuration import ZooLlamaConfig


class ZooLadderConfig(ZooLlamaConfig):
    model_type = "zoo_ladder"

    # None (the default): every layer laddered, resolved to num_hidden_layers by `validate`.
    ladder_layers: int | list[int] | None = None

    def validate(self) -> None:
        # Runs at construction and again after from_pretrained's keyword overrides (see ZooLlamaConfig).
        super().validate()
        n = self.num_hidden_layers
        if self.ladder_layers is None:
            self.ladder_layers = n  # the default: the paper's Ladder Transformer, every layer laddered
        if isinstance(self.ladder_layers, bool) or not isinstance(self.ladder_layers, (int, list, tuple)):
            raise ValueError(
                f"ladder_layers={self.ladder_layers!r} must be an int in 0..{n} (the number of last layers "
                f"to ladder), a list of layer indices in 0..{n - 1}, or None (every layer, the default)."
            )
        if isinstance(self.ladder_layers, int):
            if not 0 <= self.ladder_layers <= n:
                raise ValueError(
                    f"ladder_layers={self.ladder_layers} is out of range; use 0..{n} (the number of last "
                    f"layers to ladder) or a list of layer indices in 0..{n - 1}."
                )
        else:
            bad = [i for i in self.ladder_layers if isinstance(i, bool) or not (isinstance(i, int) and 0 <= i < n)]
            if bad or len(set(self.ladder_layers)) != len(self.ladder_layers):
                raise ValueError(
                    f"ladder_layers={list(self.ladder_layers)} must list distinct layer indices in 0..{n - 1}."
                )

    @property
    def laddered(self) -> frozenset[int]:
        """Indices of the laddered layers."""
        if self.ladder_layers is None:  # (validate resolves it; a config whose checks were skipped)
            return frozenset(range(self.num_hidden_layers))
        if isinstance(self.ladder_layers, int):
            return frozenset(range(self.num_hidden_layers - self.ladder_layers, self.num_hidden_layers))
        return frozenset(self.ladder_layers)
