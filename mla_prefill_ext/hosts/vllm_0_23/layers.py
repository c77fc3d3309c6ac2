"""Handing a bridged backend the reader of vLLM's MLA layers (:mod:`mla_prefill_ext.mla_layers`)."""

from __future__ import annotations

from typing import Any

from mla_prefill_ext.mla_layers import mla_layer_hyperparameters


def hand_layer_reader(backend: Any) -> None:
    """Hand a layer's backend the reader of the model's layers, as the patch does (a base-class hook)."""
    backend.accept_layer_hyperparameters(mla_layer_hyperparameters)
