"""What attention needs around `swap_in`, for any framework: a top-k narrower than the
cache's padded with -1 (`pad_top_k`), a gather of the returned rows that reads nothing for
-1 entries (`gather_rows`), and a reference sparse MLA decode attention over KV rows, in torch
with fp32 accumulation (`sparse_mla_decode_reference`).

The reference is the check that the cache is transparent: attention over
`cache.device_kv(layer)` at the rows `swap_in` returned equals attention over the full KV at
the original positions, bit for bit, because both read the same bytes in the same order. Not
a fast kernel.
"""

from __future__ import annotations

import torch

from hisparse.core.validation import check_tensor
from hisparse.errors import InvalidInputError

LATENT_DIM = 512  # DeepSeek-V3.2 / GLM-5 MLA: the value is the latent part of the key
ROPE_DIM = 64


def pad_top_k(top_k: torch.Tensor, width: int) -> torch.Tensor:
    """`top_k [..., K']` as int32 `[..., width]`, the columns past K' -1 (none).

    An indexer returns `min(index_topk, T)` columns while the context is shorter than its
    top-k; `swap_in` takes the cache's `top_k` columns. Returns `top_k` itself when it is
    already int32, contiguous and `width` wide.

    Raises:
        InvalidInputError: `top_k` is not an integer tensor, or is wider than `width`.
    """
    if not isinstance(top_k, torch.Tensor) or top_k.dtype.is_floating_point or top_k.ndim < 1:
        raise InvalidInputError(
            f"top_k must be an integer tensor [..., K], got {_describe(top_k)}; pass the "
            "indexer's top-k positions")
    columns = top_k.shape[-1]
    if columns > width:
        raise InvalidInputError(
            f"top_k has {columns} columns, more than the cache's top_k={width}; build the "
            f"cache with top_k >= the indexer's index_topk ({columns})")
    if columns == width and top_k.dtype == torch.int32 and top_k.is_contiguous():
        return top_k
    padded = torch.full((*top_k.shape[:-1], width), -1, dtype=torch.int32, device=top_k.device)
    padded[..., :columns] = top_k
    return padded


def gather_rows(kv_rows: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_rows[rows]` where `rows` is what `swap_in` returned, -1 entries read as zeros.

    In torch a -1 index reads the last row, whose bytes may be anything (a NaN in a float
    view): here a -1 entry gathers row 0 as a stand-in and its bytes are zeroed.

    Args:
        kv_rows: `[N, W]` rows (`cache.device_kv(layer)`, or a view of it in any dtype).
        rows: `[..., K]` integer rows of `kv_rows`, -1 = none.

    Returns:
        `(values [..., K, W], valid [..., K] bool)`: masked attention must still mask the
        invalid entries (a zero key scores 0, not -inf).
    """
    check_tensor("kv_rows", kv_rows, ndim=2, contiguous=False)
    if not isinstance(rows, torch.Tensor) or rows.dtype.is_floating_point:
        raise InvalidInputError(
            f"rows must be an integer tensor, got {_describe(rows)}; pass the rows swap_in "
            "returned")
    valid = rows >= 0
    values = kv_rows[torch.where(valid, rows, 0).long()]
    return values.masked_fill(~valid[..., None], 0), valid


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}"


def sparse_mla_decode_reference(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    latent_dim: int = LATENT_DIM,
    rope_dim: int = ROPE_DIM,
) -> torch.Tensor:
    """One decode token per batch row, attending to the rows `indices` selects.

    Args:
        q: `[B, heads, latent_dim + rope_dim]` queries (absorbed MLA form), any float dtype.
        kv_rows: `[N, W]` uint8 rows, each `latent_dim + rope_dim` bf16 values (the key); the
            value is the first `latent_dim` of them.
        indices: `[B, K]` int32 rows of `kv_rows`, -1 = masked.
        softmax_scale: multiplies the scores before the softmax.

    Returns:
        `[B, heads, latent_dim]` in `q`'s dtype; zeros for a batch row with no valid index.
    """
    width = latent_dim + rope_dim
    check_tensor("q", q, ndim=3)
    check_tensor("kv_rows", kv_rows, dtype=torch.uint8, ndim=2)
    check_tensor("indices", indices, dtype=torch.int32, ndim=2)
    if q.shape[-1] != width or kv_rows.shape[-1] != 2 * width:
        raise InvalidInputError(
            f"q's last dimension {q.shape[-1]} and kv_rows' row of {kv_rows.shape[-1]} bytes must "
            f"be {width} values and {2 * width} bytes (bf16 {latent_dim} latent + {rope_dim} rope)"
        )
    if indices.shape[0] != q.shape[0]:
        raise InvalidInputError(
            f"indices has {indices.shape[0]} batch rows, q has {q.shape[0]}; pass one row each"
        )
    out_of_range = (indices < -1) | (indices >= kv_rows.shape[0])
    if bool(out_of_range.any()):  # a reference may sync; a wrong index must not read as masked
        bad = int(indices[out_of_range][0])
        raise InvalidInputError(
            f"indices hold {bad}, outside -1 (masked) and 0..{kv_rows.shape[0] - 1} (the rows "
            "of kv_rows); pass the rows swap_in returned"
        )
    kv = kv_rows.view(torch.bfloat16)  # [N, width]
    valid = indices >= 0
    keys = kv[torch.where(valid, indices, 0).long()].float()  # [B, K, width]
    # Masked entries gathered row 0 as a stand-in: zero them, or a NaN or infinity in row 0
    # (whatever bytes it holds) would reach every output through 0 * NaN.
    keys = keys.masked_fill(~valid[..., None], 0.0)
    scores = torch.einsum("bhd,bkd->bhk", q.float(), keys) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    # A row with nothing to attend to would be all -inf (NaN after softmax): give it zeros.
    # Only that row: a NaN from the data itself must show, not read as a plausible zero.
    weights = torch.softmax(scores, dim=-1).masked_fill(~valid.any(-1)[:, None, None], 0.0)
    out = torch.einsum("bhk,bkd->bhd", weights, keys[..., :latent_dim])
    return out.to(q.dtype)
