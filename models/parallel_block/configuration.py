"""Configuration of the parallel-block baseline: Llama's fields; one RMSNorm per layer instead of two."""

from models.llama.configuration import ZooLlamaConfig


class ZooParallelConfig(ZooLlamaConfig):
    model_type = "zoo_parallel"

    def num_parameters_formula(self) -> int:
        return super().num_parameters_formula() - self.num_hidden_layers * self.hidden_size
