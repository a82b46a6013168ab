# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""A weighted k-nearest-neighbour classifier on frozen global features (DINO's k-NN evaluation).

`run_linear_probes` runs it beside the linear classifier when `ProbeSettings.knn_k > 0` (task `"knn"` in the
results); see docs/evaluation.md. Unlike the linear probe it has nothing to train, so it reads the geometry of the
frozen features directly.

Shape legend: N training (reference) features, M features to classify, B a batch of them, D hidden size, K classes.
"""

import numpy as np
import torch
import torch.nn.functional as F


__all__ = ["knn_classify"]


@torch.no_grad()
def knn_classify(
    train_features: torch.Tensor,
    train_labels: torch.Tensor | np.ndarray,
    eval_features: torch.Tensor,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    batch_size: int = 1024,
) -> torch.Tensor:
    r"""
    Weighted k-nearest-neighbour classification on cosine similarity, as in DINO's k-NN evaluation: each of the
    `k` most similar training features votes for its class with weight `exp(similarity / temperature)`.

    Args:
        train_features (`torch.Tensor` of shape `(N, D)`): training (reference) features.
        train_labels (`(N,)` ints): their classes.
        eval_features (`torch.Tensor` of shape `(M, D)`): the features to classify.
        num_classes (`int`): `K`.
        k (`int`, *optional*, defaults to 20): neighbours (at most `N`).
        temperature (`float`, *optional*, defaults to 0.07): the vote weights' temperature (DINO's).
        batch_size (`int`, *optional*, defaults to 1024): evaluation features per similarity matrix.

    Returns:
        `torch.Tensor` of shape `(M,)`: the predicted classes, on the CPU.
    """
    labels = torch.as_tensor(np.asarray(train_labels), dtype=torch.long)
    if len(labels) != len(train_features):
        raise ValueError(f"{len(train_features)} training features but {len(labels)} labels.")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}.")
    reference = F.normalize(train_features.float(), dim=-1)  # (N, D)
    k = min(k, len(reference))
    predictions = []
    for start in range(0, len(eval_features), batch_size):
        queries = F.normalize(eval_features[start : start + batch_size].float(), dim=-1)  # (B, D)
        similarity, neighbours = (queries @ reference.T).topk(k, dim=-1)  # (B, k) each
        votes = torch.zeros(len(queries), num_classes)
        votes.scatter_add_(1, labels[neighbours], (similarity / temperature).exp())  # (B, K)
        predictions.append(votes.argmax(-1))
    return torch.cat(predictions) if predictions else torch.zeros(0, dtype=torch.long)
