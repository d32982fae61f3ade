"""What attention reads of a step: the packed batch's cache slots, its decode rows and prefill chunks
(``attention.py`` describes how each layer uses them). Built once per step by the runner and carried by the
step's ``ForwardContext`` (``kiln.engine.forward_context``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from kiln.engine.layers.paged_metadata import PagedMetadata


@dataclass
class PrefillChunk:
    q_start: int           # offset of the chunk's first token in the packed batch
    q_len: int             # tokens computed this step
    ctx_len: int           # tokens in the cache after this step (cached + chunk)
    block_ids: torch.Tensor  # the blocks holding the first ctx_len tokens
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when q_len == ctx_len (plain causal)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                 # [num_tokens] cache slot of each new token
    num_decode_tokens: int = 0                 # leading single-token rows
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None = None    # [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_pad_mask: torch.Tensor | None = None  # ~decode_mask as [1, num_decodes, 1, ctx] (CPU decode path)
    # Reusable gather buffers (name -> flat tensor), owned by the runner and grown on demand: every
    # layer gathers the same amount, so one buffer serves all layers and every step after the first.
    workspace: dict[str, torch.Tensor] | None = None
    decode_groups: list[DecodeGroup] | None = None  # CPU decode rows grouped by context; built by the first layer
    paged: PagedMetadata | None = None  # set: the Triton kernels run this step (decode/prefill fields unused)
    # native (kernels.native.Kernels): every token is a row of kiln's C kernel; num_decode_tokens counts them all,
    # decode_block_tables / decode_ctx_lens are int32 per token, native_row_starts groups rows sharing a table
    native: Any = None
    decode_ctx_lens: torch.Tensor | None = None
    native_row_starts: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, attended together over only as many blocks as the
    longest of them holds (CPU path)."""

    rows: torch.Tensor          # indices into the step's decode rows
    block_tables: torch.Tensor  # [len(rows), width]
    pad: torch.Tensor           # [1, len(rows), 1, width * block_size], True past each row's context
