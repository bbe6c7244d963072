"""Configuration of the parallel-block baseline: Llama's fields; one RMSNorm per layer instead of two."""

from models.llama.configuration import ZooLlamaConfig


class ZooParallelConfig(ZooLlamaConfig):
    model_type = "zoo_parallel"
    residual_refusal = (
        "A parallel block computes attention and MLP from the same input and reduces their sum in one all-reduce: "
        "one sub-block per layer, not the two whose waits the ladder schedule staggers (deferring that all-reduce "
        "by a whole layer is another model, which no paper defines)."
    )

    def num_parameters_formula(self) -> int:
        return super().num_parameters_formula() - self.num_hidden_layers * self.hidden_size
