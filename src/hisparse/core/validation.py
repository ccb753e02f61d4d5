"""Input checks of the public engine calls. Each raises InvalidInputError before any change.

`check_*` functions that take only shapes, dtypes and Python values never touch the device;
the `*_against_device` ones read tensors back (a host sync) and run only with `validate=True`.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet

import torch

from hisparse.errors import InvalidInputError


def is_plain_tensor(value: object, dtype: torch.dtype, ndim: int, device: torch.device,
                    contiguous: bool = True) -> bool:
    """Whether `value` passes `check_tensor` with these arguments, for the usual tensor (a
    dense torch.Tensor, exactly of `dtype`): attribute reads (~1 us), where a per-layer call
    gives anything else `check_tensor`'s full checks and messages (3-4 us)."""
    return (type(value) is torch.Tensor and value.dtype is dtype and value.dim() == ndim
            and value.layout is torch.strided and not value.is_nested
            and value.device == device and (not contiguous or value.is_contiguous()))


def check_tensor(
    name: str,
    value: object,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    ndim: int | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    # Sparse, nested and quantized tensors have no plain rows to copy (a quantized one
    # viewed as bytes crashes torch's copy outright).
    if value.layout != torch.strided or value.is_nested or value.is_quantized:
        kind = ("nested" if value.is_nested else "quantized" if value.is_quantized
                else str(value.layout).removeprefix("torch."))
        raise InvalidInputError(
            f"{name} must be a dense (strided) tensor, got a {kind} one; convert it first "
            "(.to_dense(), .dequantize() or torch.stack of the nested parts)"
        )
    if dtype is not None and value.dtype != dtype:
        raise InvalidInputError(f"{name} must be {dtype}, got {value.dtype}; convert it first")
    if device is not None and not same_device(value.device, device):
        raise InvalidInputError(
            f"{name} must be on {device}, got {value.device}; move it to the cache's device"
        )
    if ndim is not None and value.dim() != ndim:
        raise InvalidInputError(
            f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}; pass a "
            f"{ndim}-D tensor (see the call's docstring for the layout)"
        )
    if contiguous and not value.is_contiguous():
        raise InvalidInputError(f"{name} must be contiguous; call .contiguous() on it first")
    return value


def same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` name the same device when the current index is 0."""
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def is_count(value: object) -> bool:
    """A plain int (bools are ints to Python, but `layer=True` is a bug, not layer 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_layer(layer: object, num_layers: int) -> None:
    if type(layer) is int and 0 <= layer < num_layers:  # the usual call: no more checks
        return
    if not is_count(layer) or not 0 <= layer < num_layers:  # type: ignore[operator]
        raise InvalidInputError(
            f"layer must be an int in 0..{num_layers - 1}, got {layer!r}; pass the "
            "index of one of this cache's layers"
        )


def as_rows(name: str, kv: torch.Tensor, row_bytes: int, ndim: int,
            device: torch.device | None = None) -> torch.Tensor:
    """View a KV tensor of any dtype, last dimension one token's row, as uint8 `[..., W]`.

    Any layout whose rows are each contiguous works (the copies take strided sources).
    """
    check_tensor(name, kv, ndim=ndim, device=device, contiguous=False)
    width = kv.shape[-1] * kv.element_size()
    if width != row_bytes:
        raise InvalidInputError(
            f"{name} rows are {width} bytes ({kv.shape[-1]} x {kv.dtype}), the cache's rows are "
            f"{row_bytes} bytes; pass each token's row for one layer in the last dimension"
        )
    if kv.dtype == torch.uint8:
        return kv
    if kv.stride(-1) != 1:
        raise InvalidInputError(
            f"{name} has stride {kv.stride(-1)} in its last dimension; each token's row must be "
            "contiguous: call .contiguous() on it first"
        )
    return kv.view(torch.uint8)


def check_batch_rows(name: str, rows: int, num_real: int, capacity: int) -> None:
    if not num_real <= rows <= capacity:
        raise InvalidInputError(
            f"{name} has {rows} rows; the open decode step has {num_real} requests and the "
            f"padded capacity is {capacity}: pass between {num_real} and {capacity} rows"
        )


def check_positions_against_lengths(
    top_k: torch.Tensor, seq_lens: Sequence[int], request_ids: Sequence[object]
) -> None:
    """Every real row's positions lie in [-1, seq_len) and are distinct (host sync)."""
    real = top_k[: len(seq_lens)].cpu().long()
    limits = torch.tensor(list(seq_lens), dtype=torch.long)[:, None]
    bad = (real < -1) | (real >= limits)
    if bool(bad.any()):
        b, k = (int(i) for i in bad.nonzero()[0])
        raise InvalidInputError(
            f"top_k[{b}, {k}] = {int(real[b, k])} is outside [-1, {seq_lens[b]}) for request "
            f"{request_ids[b]!r} (seq_len {seq_lens[b]}); use -1 for an empty entry"
        )
    ordered = real.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(repeated.any()):
        b, k = (int(i) for i in repeated.nonzero()[0])
        raise InvalidInputError(
            f"top_k row {b} (request {request_ids[b]!r}) lists position {int(ordered[b, k])} "
            "more than once; each position may appear once per row: drop the repeats and pad "
            "the row with -1"
        )


def check_prefill_rows(kv: torch.Tensor, layer: int | None, start: int, *, num_layers: int,
                       row_bytes: int, device: torch.device, admitted_tokens: int,
                       request_id: object, prefix_tokens: int = 0) -> torch.Tensor:
    """`write_prefill`'s `kv` as uint8 rows, checked: `[T, W]` for `layer` or `[L, T, W]`,
    on the host or the cache's device, inside the `admitted_tokens` from `start`, and not
    into a shared prefix's first `prefix_tokens` rows (already on the host)."""
    if layer is not None:
        check_layer(layer, num_layers)
    rows = as_rows("kv", kv, row_bytes, 2 if layer is not None else 3)
    if rows.device.type != "cpu" and not same_device(rows.device, device):
        raise InvalidInputError(
            f"kv is on {rows.device}; prefill rows come from the host (cpu) or the cache's "
            f"device {device}: move it to one of those first"
        )
    if layer is None and rows.shape[0] != num_layers:
        raise InvalidInputError(
            f"kv holds {rows.shape[0]} layers, the cache has {num_layers}; pass "
            "[L, T, W] for all layers, or [T, W] with layer=..."
        )
    count = rows.shape[-2]
    if not is_count(start) or start < 0:
        raise InvalidInputError(
            f"start must be a plain int >= 0 (the position of kv's first row), got {start!r}"
        )
    if start + count > admitted_tokens:
        raise InvalidInputError(
            f"prefill rows {start}..{start + count - 1} of request {request_id!r} fall "
            f"outside the {admitted_tokens} tokens it was admitted with; admit the "
            "full prompt length"
        )
    if start < prefix_tokens and count:
        raise InvalidInputError(
            f"prefill rows {start}..{start + count - 1} of request {request_id!r} start "
            f"inside its shared prefix of {prefix_tokens} tokens, which is on the host "
            f"already; pass the rows from start={prefix_tokens} (kv[..., {prefix_tokens}:, :] "
            "of the whole prompt's KV)")
    return rows


def check_current_device(current: torch.device | None, device: torch.device) -> None:
    """The thread that drives a decode step must have the cache's device current: its
    per-layer calls launch on the current device and stay cheap."""
    if current is not None and current != device:
        raise InvalidInputError(
            f"this cache lives on {device} but the current device of the thread driving the "
            f"decode step is {current}; make {device} current first "
            f"(torch.{device.type}.set_device({device.index}), or run the step under "
            f"torch.{device.type}.device({device.index}))"
        )


def as_batch_ids(request_ids: Sequence[Hashable]) -> list[Hashable]:
    """A decode batch as a list; a set or a mapping has no order to give the batch rows."""
    if type(request_ids) is list or type(request_ids) is tuple:  # the usual: no ABC checks
        return list(request_ids)
    try:
        unordered = isinstance(request_ids, str | bytes | AbstractSet | Mapping)
        ids = None if unordered else list(request_ids)
    except TypeError:
        ids = None
    if ids is None:
        raise InvalidInputError(
            f"request_ids must be a list or tuple of request ids, got "
            f"{type(request_ids).__name__} {request_ids!r}; wrap a single id in a list"
        )
    return ids


def check_request_length(num_tokens: object, max_seq_len: int, action: str) -> None:
    """A request's token count: an int in 1..max_seq_len. An integer of another type (a
    numpy integer, a 0-d tensor) is refused for its type, which is what to change."""
    if type(num_tokens) is not int and not isinstance(num_tokens, bool | float | str):
        try:
            value = operator.index(num_tokens)  # type: ignore[arg-type]
        except TypeError:
            value = None
        if value is not None:
            kind = type(num_tokens)
            raise InvalidInputError(
                f"cannot {action} a request of {value} tokens given as "
                f"{kind.__module__}.{kind.__qualname__}: the count must be a Python int; "
                "pass int(num_tokens)"
            )
    if not is_count(num_tokens) or not 1 <= num_tokens <= max_seq_len:  # type: ignore[operator]
        raise InvalidInputError(
            f"cannot {action} a request of {num_tokens!r} tokens: it must be an int in "
            f"1..{max_seq_len} (max_seq_len); pass the token count as an int, or raise "
            "max_seq_len for longer requests"
        )


def as_appends(appends: object, batch_size: int, num_tokens: int, dedupe: bool
               ) -> tuple[int, ...] | None:
    """`begin_decode_step`'s `appends`: None, or how many rows each request appends (0 to
    `num_tokens`, a list, tuple or 1-D int tensor of `batch_size` entries; a tensor is read
    once). None when every request of a single-token step appends one: such a step takes
    the every-request path."""
    if appends is None:
        return None
    S = num_tokens
    if dedupe:
        raise InvalidInputError(
            f"appends is for single-token steps and verify steps without dedupe, got "
            f"dedupe={dedupe}; pass appends=None to a dedupe step, or dedupe=False")
    if isinstance(appends, torch.Tensor):
        if appends.ndim != 1 or appends.is_floating_point() or appends.is_complex():
            raise InvalidInputError(
                f"appends must be a 1-D integer tensor, got {appends.dtype} of shape "
                f"{tuple(appends.shape)}; pass one count (0..{S}) per request")
        values: list[object] = appends.tolist()
    elif type(appends) is list or type(appends) is tuple:
        values = list(appends)
    else:
        raise InvalidInputError(
            f"appends must be a list, tuple or 1-D int tensor, got "
            f"{type(appends).__name__} {appends!r:.80}; pass one count (0..{S}) per request")
    if len(values) != batch_size:
        raise InvalidInputError(
            f"appends has {len(values)} entries for a batch of {batch_size} requests; "
            f"pass one count (0..{S}) per request, in the batch's order")
    bad = [(b, v) for b, v in enumerate(values) if type(v) is not int or not 0 <= v <= S]
    if bad:
        b, v = bad[0]
        raise InvalidInputError(
            f"appends[{b}] = {v!r}: a step of num_tokens={S} appends 0..{S} rows a request; "
            f"pass plain ints in 0..{S}")
    counts = tuple(values)  # type: ignore[arg-type]
    return None if S == 1 and all(counts) else counts
