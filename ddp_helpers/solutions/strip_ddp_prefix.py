"""Exercise (lesson 05): load a checkpoint saved from the DDP wrapper into a plain model."""

PREFIX = "module."


def strip_ddp_prefix(state_dict: dict) -> dict:
    """The same tensors, with the "module." DDP puts in front of every key removed."""
    # torch.nn.modules.utils.consume_prefix_in_state_dict_if_present does this in place.
    return {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in state_dict.items()}
