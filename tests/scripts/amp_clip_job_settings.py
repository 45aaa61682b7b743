"""The model and sizes of tests/scripts/amp_clip_job.py, shared with its test."""

import torch

STEPS, BATCH, INF_STEP, MAX_NORM = 8, 16, 3, 0.5


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
