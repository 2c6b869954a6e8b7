"""cuda_src/rope_quantize.cu transcribed to Python, run over host memory: launch(fields, grid,
spec) executes every thread of a recorded launch (tests/fakes.py's issued_launches: the
parameter block's fields at issue time), reading and writing the arrays behind its pointers
(PyTorch CPU tensors standing in for device arrays). With it the CPU checks the host side
(validation, strides, pointers, the grid) and the kernel's index math together against the
float64 reference; the GPU tests check the kernel itself."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from rtcinfer.interop.dtypes import numpy_dtype

THREADS = 128


def span(a) -> tuple[int, int]:
    """(address, bytes) of a dense PyTorch CPU tensor or host-backed CuPy array."""
    if hasattr(a, "data_ptr"):
        return a.data_ptr(), a.numel() * a.element_size()
    return a.data.ptr, a.nbytes


def allocation(a) -> tuple[int, int]:
    """(address, bytes) of the whole memory an array (maybe a strided view) lies in."""
    if hasattr(a, "untyped_storage"):
        storage = a.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    return a.data.mem.ptr, a.data.mem.size


class Memory:
    """Host arrays by address (PyTorch CPU tensors, host-backed CuPy arrays): element reads and
    writes at (pointer, element offset)."""

    def __init__(self, arrays):
        self.arrays = []
        for a in arrays:
            address, size = (0, 0) if a is None else allocation(a)
            if size:
                raw = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))
                self.arrays.append((address, raw))

    def _bytes(self, address: int, size: int) -> np.ndarray:
        for base, raw in self.arrays:
            if base <= address and address + size <= base + raw.size:
                return raw[address - base : address - base + size]
        raise AssertionError(f"address {address:#x} (+{size}) is in no array of the call")

    def read(self, ptr: int, index: int, dtype: str) -> float:
        item = np.dtype(numpy_dtype(dtype)).itemsize
        return float(self._bytes(ptr + index * item, item).view(numpy_dtype(dtype))[0])

    def write_fp8(self, ptr: int, index: int, value: float, dtype: str) -> None:
        code = np.array([value], np.float32).astype(numpy_dtype(dtype)).view(np.uint8)
        self._bytes(ptr + index, 1)[:] = code


def _fp8_saturated(x: float, dtype: str) -> float:
    top = float(ml_dtypes.finfo(numpy_dtype(dtype)).max)
    return x if np.isnan(x) else min(max(x, -top), top)


def launch(f: dict, grid: tuple, spec, memory: Memory) -> list[tuple]:
    """Run the launch: every (token, unit) thread. Returns the bad entries it reported, as
    (code name, index, value, limit)."""
    rope, nope, vec = spec.rope_dim, spec.nope_dim, spec.vec
    half, rope_units, head_units = rope // 2, rope // vec, (rope + nope) // vec
    v_units = (rope + nope) // vec if spec.with_v else 0
    reports = []
    for t in range(grid[0]):
        for u in range(grid[1] * THREADS):
            q_units, k_units = f["num_q_heads"] * head_units, f["num_k_heads"] * head_units
            if u >= q_units + k_units + f["num_k_heads"] * v_units:
                continue
            is_q = u < q_units
            is_k = not is_q and u < q_units + k_units
            r = u if is_q else u - q_units if is_k else u - q_units - k_units
            h = r // head_units if is_q or is_k else r // v_units
            c = r - h * head_units if is_q or is_k else r - h * v_units
            rotary = (is_q or is_k) and c < rope_units
            e0 = (c if rotary or not (is_q or is_k) else c - rope_units) * vec
            _unit(f, spec, memory, t, u, is_q, is_k, h, rotary, e0, half, reports)
    return reports


def _unit(f, spec, memory, t, u, is_q, is_k, h, rotary, e0, half, reports):
    vec, out_type = spec.vec, spec.out_dtype
    reporter = u == 0
    page = slot = 0
    if spec.append:
        b = int(memory.read(f["batch_indices"], t, spec.row_index_dtype))
        p = int(memory.read(f["positions"], t, spec.row_index_dtype))
        if b < 0 or p < 0:
            if is_q:
                ptr, at = _q_out(f, t, h, rotary)
                for j in range(vec):
                    memory.write_fp8(ptr, at + e0 + j, 0.0, out_type)
            return
        if not is_q or reporter:
            page, slot = _cache_slot(f, spec, memory, t, b, p, reporter, reports)
        if not is_q and page < 0:
            return
    if rotary:
        pos = int(memory.read(f["pos_ids"], t, spec.pos_dtype))
        inside = 0 <= pos < f["max_pos"]
        if not inside and reporter:
            reports.append(("QUANT_COS_SIN_POSITIONS", t, pos, f["max_pos"]))
        src, at = ((f["q_rope"], t * f["q_rope_tok"] + h * f["q_rope_head"]) if is_q else
                   (f["k_rope"], t * f["k_rope_tok"] + h * f["k_rope_head"]))  # fmt: skip
        x = [memory.read(src, at + e0 + j, spec.dtype) for j in range(vec)]
        if inside:
            cs = [memory.read(f["cos_sin_cache"], pos * spec.rope_dim + i, "float32")
                  for i in range(spec.rope_dim)]  # fmt: skip
            x = _rotate(x, memory, src, at, e0, cs, spec, half)
    else:
        src, at = ((f["q_nope"], t * f["q_nope_tok"] + h * f["q_nope_head"]) if is_q else
                   (f["k_nope"], t * f["k_nope_tok"] + h * f["k_nope_head"]) if is_k else
                   (f["v"], t * f["v_tok"] + h * f["v_head"]))  # fmt: skip
        x = [memory.read(src, at + e0 + j, spec.dtype) for j in range(vec)]
    if is_q:
        ptr, at = _q_out(f, t, h, rotary)
    elif spec.append:
        ptr, at = (
            (f["v_out"], page * f["v_page"] + slot * f["v_slot"] + h * f["v_hd"])
            if not is_k
            else (f["k_rope_out"], page * f["kr_page"] + slot * f["kr_tok"] + h * f["kr_head"])
            if rotary
            else (f["k_nope_out"], page * f["kn_page"] + slot * f["kn_tok"] + h * f["kn_head"])
        )
    else:
        ptr, at = ((f["k_rope_out"], t * f["kr_tok"] + h * f["kr_head"]) if rotary else
                   (f["k_nope_out"], t * f["kn_tok"] + h * f["kn_head"]))  # fmt: skip
    scale = np.float32(f["scale_q"] if is_q else f["scale_kv"])
    for j in range(vec):
        value = float(np.float32(np.float32(x[j]) * scale))
        memory.write_fp8(ptr, at + e0 + j, _fp8_saturated(value, out_type), out_type)


def _q_out(f, t, h, rotary):
    if rotary:
        return f["q_rope_out"], t * f["qr_out_tok"] + h * f["qr_out_head"]
    return f["q_nope_out"], t * f["qn_out_tok"] + h * f["qn_out_head"]


def _rotate(x, memory, src, at, e0, cs, spec, half):
    vec = spec.vec
    out = list(x)
    if spec.interleave:
        for j in range(vec // 2):
            c, s = cs[e0 // 2 + j], cs[half + e0 // 2 + j]
            a, b = x[2 * j], x[2 * j + 1]
            out[2 * j], out[2 * j + 1] = a * c - b * s, b * c + a * s
        return out
    first = e0 < half
    i0 = e0 if first else e0 - half
    partner_at = at + (e0 + half if first else e0 - half)
    for j in range(vec):
        c, s = cs[i0 + j], cs[half + i0 + j]
        y = memory.read(src, partner_at + j, spec.dtype)
        out[j] = x[j] * c - y * s if first else x[j] * c + y * s
    return out


def _cache_slot(f, spec, memory, t, b, p, reporter, reports) -> tuple[int, int]:
    def report(*entry):
        if reporter:
            reports.append(entry)
        return -1, 0

    if b >= f["batch_size"]:
        return report("QUANT_BATCH_INDICES", t, b, f["batch_size"])
    begin = int(memory.read(f["kv_indptr"], b, spec.index_dtype))
    end = int(memory.read(f["kv_indptr"], b + 1, spec.index_dtype))
    page_in_request, pages = p // f["page_size"], end - begin
    if page_in_request >= pages:
        return report("QUANT_POSITIONS", t, p, max(pages, 0) * f["page_size"])
    entry = begin + page_in_request
    if begin < 0 or entry >= f["num_indices"]:
        return report("QUANT_KV_INDPTR", b, entry, f["num_indices"])
    page = int(memory.read(f["kv_indices"], entry, spec.index_dtype))
    if page < 0 or page >= f["num_pages"]:
        return report("QUANT_KV_INDICES", entry, page, f["num_pages"])
    return page, p - page_in_request * f["page_size"]
