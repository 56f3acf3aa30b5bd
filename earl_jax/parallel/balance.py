"""Token balancing: a batch permutation that gives every data shard about as many real tokens.

Host metadata only (per-sample lengths); the dispatcher applies the permutation on device while
it moves the batch, and consumers undo it with ``inverse_permutation``.
"""

from __future__ import annotations

import heapq

import numpy as np


def balance_permutation(lengths_B: np.ndarray, num_shards: int) -> np.ndarray:
  """``perm_B`` such that ``batch[perm_B]`` balances real tokens over contiguous shards.

  Greedy longest-first: each sample goes to the shard with the fewest tokens that still has room;
  every shard gets exactly B / num_shards samples (shard s owns rows s*B/n .. (s+1)*B/n - 1).
  """
  lengths_B = np.asarray(lengths_B)
  b = lengths_B.shape[0]
  if lengths_B.ndim != 1 or num_shards < 1 or b % num_shards:
    raise ValueError(
      f"balance_permutation needs 1-D lengths whose count divides num_shards; got shape "
      f"{lengths_B.shape} and num_shards={num_shards}"
    )
  per_shard = b // num_shards
  heap = [(0, s) for s in range(num_shards)]  # (tokens, shard); full shards leave the heap
  members: list[list[int]] = [[] for _ in range(num_shards)]
  for i in np.argsort(-lengths_B, kind="stable"):
    tokens, shard = heapq.heappop(heap)
    members[shard].append(int(i))
    if len(members[shard]) < per_shard:
      heapq.heappush(heap, (tokens + int(lengths_B[i]), shard))
  return np.concatenate([np.array(m, dtype=np.int32) for m in members])


def inverse_permutation(perm_B: np.ndarray) -> np.ndarray:
  """``inv`` with ``batch[perm][inv] == batch``."""
  perm_B = np.asarray(perm_B)
  inv_B = np.empty_like(perm_B)
  inv_B[perm_B] = np.arange(perm_B.shape[0], dtype=perm_B.dtype)
  return inv_B


def tokens_per_shard(lengths_B: np.ndarray, num_shards: int) -> tuple[int, ...]:
  """Real tokens in each contiguous batch shard."""
  lengths_B = np.asarray(lengths_B)
  return tuple(int(x) for x in lengths_B.reshape(num_shards, -1).sum(axis=1))
