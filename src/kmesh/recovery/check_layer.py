"""The check layer: the early layer whose keys recovery compares with the reused ones (the gate,
kv_deviation) and whose queries rank the reused tokens (query), per model.

Layer 0 cannot serve: its keys depend on the token and position only, so re-rotated keys never
deviate there.
"""

from kmesh.compute.config import ModelConfig


def default_check_layer(config: ModelConfig) -> int:
    """The check layer of a model when none is given: 1 on a model without sliding windows (or
    whose first layer is global, or with no global layer), else its first global layer (5 on
    Gemma 3: five windowed layers, then a global one). Measured on Gemma 3 270M
    (docs/design/collective-recovery.md, "The gate"): rows chosen by their deviation at layer 1,
    whose keys have seen only the window before them, did about as well as rows chosen at
    random; chosen at the first global layer they beat chance, and the recovery's KL was no
    worse than layer 1's given the same compute (a higher ratio)."""
    first_global = next((i for i, w in enumerate(config.windows) if w is None), None)
    return 1 if first_global is None else max(1, first_global)


def check_layer_for(check_layer: int | None, config: ModelConfig) -> int:
    """The check layer to use on a model: the one given (checked against its layers) or its
    default."""
    if check_layer is None:
        return default_check_layer(config)
    if check_layer < 1:
        raise ValueError(f"check layer {check_layer}: it must be >= 1 (layer 0 cannot deviate)")
    if check_layer >= config.num_layers:
        raise ValueError(
            f"check layer {check_layer} is not below the model's {config.num_layers} layers"
        )
    return check_layer
