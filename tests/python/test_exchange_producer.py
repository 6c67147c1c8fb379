"""The DLPack C exchange path with a producer that hands out owned tensors.

torch's exchange table fills a caller's DLTensor (`dltensor_from_py_object_no_sync`), so
the torch tests never reach the other conversion the protocol allows: a
`DLManagedTensorVersioned` the consumer owns and must release through its deleter. The
producer here is built with ctypes around NumPy arrays and offers only that conversion,
so these tests run everywhere (no torch, no GPU). They check that every tensor handed
out is released exactly once, whether the call runs, declines (a read-only output, a
refusing producer) or fails validation, and that the results equal the NumPy path's.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import numpy as np
import pytest

import pagedattn
from conftest import make_problem
from pagedattn import _core


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]  # fmt: skip


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", DELETER),
                                     ("flags", c_uint64), ("dl_tensor", DLTensor)]  # fmt: skip
FROM_PY = ctypes.CFUNCTYPE(c_int, c_void_p, POINTER(POINTER(DLManagedTensorVersioned)))
STREAM = ctypes.CFUNCTYPE(c_int, c_int32, c_int32, POINTER(c_void_p))


class Api(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("prev_api", c_void_p), ("managed_tensor_allocator", c_void_p),
                ("managed_tensor_from_py_object_no_sync", FROM_PY), ("managed_tensor_to_py_object_no_sync", c_void_p),
                ("dltensor_from_py_object_no_sync", c_void_p), ("current_work_stream", STREAM)]  # fmt: skip


DTYPES = {np.dtype(np.float32): (2, 32), np.dtype(np.float16): (2, 16), np.dtype(np.int32): (0, 32),
          np.dtype(np.int64): (0, 64)}  # fmt: skip
LIVE: dict = {}  # address of each tensor handed out and not yet released -> what it keeps alive
COUNTS = {"made": 0, "freed": 0}


@DELETER
def _release(m):
    LIVE.pop(ctypes.addressof(m.contents))  # a second release of the same tensor raises here
    COUNTS["freed"] += 1


@FROM_PY
def _from_py(obj, out):
    w = ctypes.cast(obj, ctypes.py_object).value
    if w.refuse:
        return -1
    a = w.array
    m = DLManagedTensorVersioned()
    shape = (c_int64 * a.ndim)(*a.shape)
    strides = (c_int64 * a.ndim)(*(s // a.itemsize for s in a.strides))
    code, bits = DTYPES[a.dtype]
    m.version = DLPackVersion(1, 3)
    m.deleter = _release
    m.flags = 1 if w.read_only else 0
    m.dl_tensor = DLTensor(a.ctypes.data, DLDevice(1, 0), a.ndim, DLDataType(code, bits, 1), shape, strides, 0)
    LIVE[ctypes.addressof(m)] = (m, shape, strides, a)
    COUNTS["made"] += 1
    out[0] = ctypes.pointer(m)
    return 0


@STREAM
def _stream(device_type, device_id, out):
    out[0] = None
    return 0


_API = Api(DLPackVersion(1, 3), None, None, _from_py, None, None, _stream)
_NAME = b"dlpack_exchange_api"  # the capsule keeps a pointer to this name
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = (c_void_p, ctypes.c_char_p, c_void_p)


class Owned:
    """A NumPy array behind an exchange table that hands out owned tensors only; the
    general path reaches the same memory through ``__dlpack__``."""

    __dlpack_c_exchange_api__ = _new_capsule(ctypes.addressof(_API), _NAME, None)

    def __init__(self, array, *, read_only=False, refuse=False):
        self.array, self.read_only, self.refuse = array, read_only, refuse

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


@pytest.fixture(autouse=True)
def _balanced():
    COUNTS.update(made=0, freed=0)
    yield
    assert not LIVE, f"{len(LIVE)} tensors handed out were never released"
    assert COUNTS["made"] == COUNTS["freed"]


def _problem(rng):
    p = make_problem(rng, [1, 17, 40], num_heads=4, num_kv_heads=2, head_size=64)
    out = np.full(p.query.shape, np.nan, np.float32)
    return p, out, pagedattn.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens)


def test_the_producer_offers_a_table():
    assert _core.exchange_api_available(Owned(np.zeros(1, np.float32)))


def test_decode_through_owned_tensors(rng):
    p, out, ref = _problem(rng)
    w = [Owned(a) for a in (p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens)]
    wout = Owned(out)
    assert pagedattn.paged_attention(*w, out=wout) is wout
    np.testing.assert_array_equal(out, ref)
    assert COUNTS["made"] == 6  # every array through the table, none through __dlpack__


def test_read_only_out_is_refused_and_released(rng):
    p, out, _ = _problem(rng)
    w = [Owned(a) for a in (p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens)]
    with pytest.raises(ValueError, match="out: the array is read-only; pagedattn writes into it"):
        pagedattn.paged_attention(*w, out=Owned(out, read_only=True))
    assert np.isnan(out).all()
    assert COUNTS["made"] == 6


def test_a_refused_array_goes_through_dlpack(rng):
    p, out, ref = _problem(rng)
    w = [Owned(a) for a in (p.query, p.key_cache, p.value_cache)]
    w += [Owned(p.block_tables, refuse=True), Owned(p.seq_lens)]
    wout = Owned(out)
    assert pagedattn.paged_attention(*w, out=wout) is wout
    np.testing.assert_array_equal(out, ref)
    assert COUNTS["made"] == 5  # block_tables through __dlpack__, the rest through the table


def test_prepared_call_holds_its_tensors_until_it_dies(rng):
    p, out, ref = _problem(rng)
    w = [Owned(a) for a in (p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens)]
    prepared = pagedattn.prepare_decode(*w, out=Owned(out))
    run = prepared.run
    del prepared, w
    assert len(LIVE) == 6  # held by the prepared call, not released after preparing
    run()
    np.testing.assert_array_equal(out, ref)
    del run
    assert not LIVE


def test_validation_errors_release_everything(rng):
    p, out, _ = _problem(rng)
    bad_lens = p.seq_lens.astype(np.int64)  # seq_lens must be int32
    w = [Owned(a) for a in (p.query, p.key_cache, p.value_cache, p.block_tables, bad_lens)]
    with pytest.raises(TypeError, match="seq_lens"):
        pagedattn.paged_attention(*w, out=Owned(out))
    assert COUNTS["made"] >= 6


def test_cache_write_through_owned_tensors(rng):
    kshape, vshape = pagedattn.kv_cache_shape(4, 16, 2, 64, np.float16)
    kc, vc = np.full(kshape, np.nan, np.float16), np.full(vshape, np.nan, np.float16)
    key = rng.standard_normal((5, 2, 64)).astype(np.float16)
    value = rng.standard_normal((5, 2, 64)).astype(np.float16)
    slots = rng.permutation(64)[:5].astype(np.int64)
    kc_ref, vc_ref = kc.copy(), vc.copy()
    pagedattn.reshape_and_cache(key, value, kc_ref, vc_ref, slots)
    pagedattn.reshape_and_cache(Owned(key), Owned(value), Owned(kc), Owned(vc), Owned(slots))
    np.testing.assert_array_equal(kc, kc_ref)
    np.testing.assert_array_equal(vc, vc_ref)
    assert COUNTS["made"] == 5
