"""GradCache-style chunking: the loss over a whole batch, with memory bounded by one chunk.

Plain gradient accumulation splits the batch, and with it the negatives: each micro-batch's queries see
only that micro-batch's candidates. Chunking keeps the whole batch's negatives::

    1. no grad:  embed every chunk (queries, positives, hard negatives); keep only the embeddings
    2. grad:     the loss on all embeddings (gathered across ranks), backward to the embeddings only
    3. replay:   per chunk, embed again with grad and backpropagate that chunk's embedding gradient

Step 3 must compute what step 1 did: dropout masks come from the training step's
:func:`~workbench.kernels.dropout.dropout_scope`, keyed by each sample's index in the global batch, so
each chunk runs under a scope with its own first sample in both passes (and torch's RNG state is
restored before each replay for anything else that draws). The parameter gradients then equal the
full batch's (``tests/test_embedding.py``), and activation memory is one chunk's: the effective batch is
bounded by the data, not by memory. The cost is a second forward.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch

from workbench.kernels.dropout import dropout_scope


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def cached_backward(encoder, loss_fn, batch: dict[str, tuple[torch.Tensor, torch.Tensor]], chunk: int, *,
                    seed: int = 0, step: int = 0, first_sample: int = 0,
                    sync: Callable[[bool], ContextManager] | None = None) -> torch.Tensor:
    """Accumulate into the parameters' ``.grad`` the gradient of ``loss_fn(**embeddings)`` over the whole
    ``batch`` (``{"queries": (tokens, lengths), "positives": ..., "hard": ...}``), ``chunk`` rows at a time.

    ``first_sample``: this rank's first row in the global batch (dropout masks follow the samples).
    ``sync(last)``: the context of each replay's forward and backward, told whether it is the last one:
    a data-parallel engine reduces gradients only there (DDP's ``no_sync`` before it; FSDP2's
    ``set_requires_gradient_sync``), as gradient accumulation does. Returns the loss (detached)."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be at least 1")
    n = next(iter(batch.values()))[0].shape[0]

    def scope(start: int, part: int):
        # each part (queries, positives, hard) is a distinct set of samples: its own block of indices
        return dropout_scope(seed=seed, step=step, first_sample=first_sample + start + part * 1_000_000_007)

    rng: dict[tuple[str, int], torch.Tensor] = {}
    reps: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for part, (name, (tokens, lengths)) in enumerate(batch.items()):
            outs = []
            for a, b in _chunks(n, chunk):
                rng[(name, a)] = torch.get_rng_state()
                with scope(a, part):
                    outs.append(encoder(tokens[a:b], lengths[a:b]))
            reps[name] = torch.cat(outs).requires_grad_(True)
    loss = loss_fn(**reps)
    loss.backward()  # gradients w.r.t. the embeddings only (and the loss's own parameters)
    replays = [(part, name, a, b) for part, name in enumerate(batch) for a, b in _chunks(n, chunk)]
    for i, (part, name, a, b) in enumerate(replays):
        tokens, lengths = batch[name]
        saved = torch.get_rng_state()
        torch.set_rng_state(rng[(name, a)])
        # backward inside the scope too: activation checkpointing recomputes the forward there
        with (sync or _no_context)(i == len(replays) - 1), scope(a, part):
            emb = encoder(tokens[a:b], lengths[a:b])
            torch.set_rng_state(saved)
            emb.backward(reps[name].grad[a:b])
    return loss.detach()


def _no_context(last: bool) -> ContextManager:
    return nullcontext()


def full_backward(encoder, loss_fn, batch: dict[str, tuple[torch.Tensor, torch.Tensor]], *, seed: int = 0,
                  step: int = 0, first_sample: int = 0) -> torch.Tensor:
    """The same gradient in one pass (all activations at once): the reference chunking must equal."""
    reps = {}
    for part, (name, (tokens, lengths)) in enumerate(batch.items()):
        with dropout_scope(seed=seed, step=step, first_sample=first_sample + part * 1_000_000_007):
            reps[name] = encoder(tokens, lengths)
    loss = loss_fn(**reps)
    loss.backward()
    return loss.detach()
