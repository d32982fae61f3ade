"""Host memory from the OS (``kiln.engine.host_pages``): packed weight panels in huge pages, the KV pool never, both
unmapped with their last tensor; and the packs that use it give the bytes they gave before."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from engine_testlib import mapping_fields
from kiln.engine.host_pages import HUGE_PAGE, anonymous


def _mapped(lo: int, hi: int) -> list[str]:
    return [line for line in open("/proc/self/maps")
            if (lambda a, b: a < hi and lo < b)(*(int(x, 16) for x in line.split()[0].split("-")))]


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not THP, reason="no transparent huge pages on this host")
def test_weight_panels_ask_for_huge_pages_aligned_to_them_and_go_with_their_last_tensor():
    nbytes = 3 * HUGE_PAGE + 12345
    t = anonymous(nbytes, huge=True)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and t.data_ptr() % HUGE_PAGE == 0
    assert float(t[:: 4096].float().sum()) == 0.0  # zero pages
    fields = mapping_fields(t)
    assert "hg" in fields["VmFlags"] and "nh" not in fields["VmFlags"], fields
    t.fill_(7)
    assert int(t[-1]) == 7 and int(t[0]) == 7
    view = t[HUGE_PAGE:]  # a view keeps the mapping
    lo, hi = t.data_ptr(), t.data_ptr() + nbytes
    del t
    assert _mapped(lo, hi) and int(view[0]) == 7
    del view
    assert _mapped(lo, hi) == [], "the panels' pages are still mapped"


def test_small_buffers_and_the_kv_pool_never_ask_for_huge_pages():
    small = anonymous(HUGE_PAGE - 4096, huge=True)  # under one huge page: none to ask for
    pool = anonymous(8 * HUGE_PAGE, huge=False)
    for t in (small, pool):
        assert "hg" not in mapping_fields(t)["VmFlags"]
    if hasattr(mmap, "MADV_NOHUGEPAGE") and THP:
        assert "nh" in mapping_fields(pool)["VmFlags"]
    assert anonymous(0, huge=True).numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_packed_into_huge_pages_multiplies_as_before(dtype):
    from kiln.engine.kernels import native

    kernels = native.kernels()
    if kernels is None or dtype not in kernels.linear_dtypes:
        pytest.skip(f"kiln's CPU kernels do not multiply {dtype} on this host")
    g = torch.Generator().manual_seed(0)
    # SmolLM2's gate|up: 7 MB of float32 panels, 3.5 MB of bf16 (over one huge page in either: its down
    # projection's 1.8 MB of bf16 is under one, and asks for none)
    w = torch.randn(3072, 576, generator=g).to(dtype)
    x = torch.randn(5, 576, generator=g).to(dtype)
    packed = kernels.pack_linear(w)
    assert packed.panels.data_ptr() % HUGE_PAGE == 0
    assert "hg" in mapping_fields(packed.panels)["VmFlags"] or not THP
    torch.testing.assert_close(packed(x).float(), torch.nn.functional.linear(x.float(), w.float()).to(dtype).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(3, 5), (64, 16), (65, 17), (130, 37), (200, 33), (129, 64)])
def test_panels_hold_the_weight_in_their_layout(n, k, dtype):
    """float32 [ceil(n / P)][K][P] and bf16 [ceil(n / P)][pairs][P][2] (pairs: K's, padded to whole AMX tiles),
    past n and K zero, from a weight whose rows are strided: the blocked packers (16 of K at a time) write what the
    column-by-column ones did, whatever K's remainder."""
    from kiln.engine.kernels import native

    kernels = native.kernels()
    if kernels is None or dtype not in kernels.linear_dtypes:
        pytest.skip(f"kiln's CPU kernels do not pack {dtype} on this host")
    panel = kernels.linear_panel
    depth = k if dtype == torch.float32 else 2 * kernels.bf16_panel_pairs(k)
    wide = torch.randn(n, k + 7, generator=torch.Generator().manual_seed(n * k)).to(dtype)
    w = wide[:, :k]  # row stride k + 7
    padded = torch.zeros(-(-n // panel) * panel, depth, dtype=dtype)
    padded[:n, :k] = w
    if dtype == torch.float32:
        expected = padded.view(-1, panel, k).transpose(1, 2)
    else:
        expected = padded.view(-1, panel, depth // 2, 2).transpose(1, 2)
    assert torch.equal(kernels.pack_linear(w).panels.reshape(expected.shape), expected)


def test_a_kernel_without_transparent_huge_pages_only_loses_the_hint():
    from kiln.engine import host_pages

    class NoTHP:  # madvise(MADV_HUGEPAGE) on a kernel built without THP: EINVAL
        def madvise(self, *args: int) -> None:
            raise OSError(22, "Invalid argument")

    host_pages._advise(NoTHP(), getattr(mmap, "MADV_HUGEPAGE", 14), 0, HUGE_PAGE)  # no error


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not THP, reason="no transparent huge pages on this host")
def test_an_arena_lays_small_weights_side_by_side_in_huge_pages_and_goes_with_the_last(monkeypatch):
    from kiln.engine import host_pages

    monkeypatch.delenv("KILN_HUGE_PAGES", raising=False)
    sizes = [324 * 1024, 5000, HUGE_PAGE + 1, 1 << 20]  # SmolLM2's int8 576x576, a bias-sized one, 2 MiB + 1, ...
    with host_pages.arena():
        pieces = [anonymous(n, huge=True) for n in sizes]
        big = anonymous(host_pages.ARENA_CHUNK // 2 + 1, huge=True)  # over half a chunk: its own mapping
    outside = anonymous(sizes[0], huge=True)  # the arena ends with its block
    base = pieces[0].data_ptr()
    assert base % HUGE_PAGE == 0
    for n, piece, nxt in zip(sizes, pieces, pieces[1:], strict=False):
        assert piece.numel() == n and nxt.data_ptr() == piece.data_ptr() + -(-n // host_pages.ARENA_ALIGN) * 4096
    for piece in pieces:
        assert "hg" in mapping_fields(piece)["VmFlags"]
        assert piece.untyped_storage().data_ptr() == pieces[0].untyped_storage().data_ptr(), "not one chunk"
    assert big.untyped_storage().data_ptr() != pieces[0].untyped_storage().data_ptr()
    assert "hg" not in mapping_fields(outside)["VmFlags"], "a small buffer outside an arena asked for huge pages"
    for piece in pieces:
        piece.fill_(3)
    lo = pieces[0].untyped_storage().data_ptr()
    chunk = _mapped(lo, lo + 1)  # the chunk's mapping, as /proc/self/maps lists it
    last = pieces.pop()
    del piece, nxt  # the loops' names hold pieces too
    pieces.clear()
    assert _mapped(lo, lo + 1) == chunk and int(last[-1]) == 3, "a piece still held lost its chunk"
    del last
    assert not set(_mapped(lo, lo + 1)) & set(chunk), "the chunk outlived its last weight"


def test_without_huge_pages_an_arena_hands_out_plain_buffers(monkeypatch):
    from kiln.engine import host_pages

    monkeypatch.setenv("KILN_HUGE_PAGES", "0")
    with host_pages.arena():
        a, b = anonymous(4096, huge=True), anonymous(4096, huge=True)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert "hg" not in mapping_fields(a)["VmFlags"]


def test_an_engine_packs_its_small_weights_into_one_arena(toy_model, make_llm):
    from kiln.engine.kernels import native
    from kiln.engine.kernels.packed import PackedLinear

    if native.kernels() is None:
        pytest.skip("kiln's CPU kernels do not load on this host")
    llm = make_llm(toy_model("llama-tiny"), num_kv_blocks=16, device="cpu", tactics="kiln-fma")
    chunks = {m.packed_weight.panels.untyped_storage().data_ptr()
              for m in llm.engine.runner.model.modules()
              if isinstance(getattr(m, "packed_weight", None), PackedLinear)}
    assert len(chunks) == 1, f"the toy model's linears lie in {len(chunks)} mappings"
