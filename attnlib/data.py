"""The six-token running example: "Your journey starts with one step", embedded in 3-D."""

import torch

SIX_WORDS = ("Your", "journey", "starts", "with", "one", "step")

SIX_TOKENS = torch.tensor(
    [
        [0.43, 0.15, 0.89],  # Your
        [0.55, 0.87, 0.66],  # journey
        [0.57, 0.85, 0.64],  # starts
        [0.22, 0.58, 0.33],  # with
        [0.77, 0.25, 0.10],  # one
        [0.05, 0.80, 0.55],  # step
    ]
)  # [6, 3]
