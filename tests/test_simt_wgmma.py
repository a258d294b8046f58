"""Hopper's warpgroup MMA (wgmma) as the SIMT executor emulates it (csrc/simt/wgmma.h, kernels/wgmma.cuh), run through
tests/simt's wgmma_steps kernel. The shared-memory images, descriptors and fragment maps are built here from the PTX
ISA's wgmma section (9.7.15: matrix descriptor format, shared memory matrix layouts and strides, swizzling modes,
register fragments), not from the C++ helpers, and the products are checked against float64 matmuls."""
import zlib

import pytest
import torch

pytestmark = pytest.mark.simt

DTYPES = {torch.bfloat16: 0, torch.float16: 1}  # the op's dtype codes
SWIZZLES = {"none": (0, 0), "128B": (1, 128), "64B": (2, 64), "32B": (3, 32)}  # descriptor mode, width in bytes


def descriptor(start, lbo, sbo, mode, base_offset=0):
    """The ISA's matrix descriptor: bits 0-13 the start address, 16-29 the leading dimension byte offset, 32-45 the
    stride dimension byte offset, each encoded as (x & 0x3FFFF) >> 4; bits 49-51 the matrix base offset; bits 62-63
    the swizzle mode (0 none, 1 128-byte, 2 64-byte, 3 32-byte). As the signed int64 a tensor holds."""
    enc = lambda x: (x & 0x3FFFF) >> 4  # noqa: E731
    d = enc(start) | enc(lbo) << 16 | enc(sbo) << 32 | base_offset << 49 | mode << 62
    return d - (1 << 64) if d >= 1 << 63 else d


def swizzled(addr, width):
    """The ISA's swizzling modes: memory is seen as rows of `width` bytes (32, 64 or 128) made of 16-byte granules,
    and granule i of a row is stored at granule i XOR (the row's 128-byte line number, modulo width / 16), a pattern
    repeating every 8 rows (256, 512, 1024 bytes). Patterns begin on those boundaries (base offset 0)."""
    if width == 0:
        return addr
    return addr ^ ((addr // 128) % (width // 16)) << 4


def element_offset(mn, k, mn_major, width, lbo, sbo):
    """Unswizzled byte offset, from the matrix start, of the 16-bit element (mn, k): mn is A's row m or B's column n.

    The ISA's canonical layouts are built of core matrices of 8 rows x 16 bytes, tiled into swizzle atoms (its table
    of atom shapes, in 16-byte units: none K 8x1 / MN 1x8, 32B K 8x2 / MN 2x8, 64B K 8x4 / MN 4x8, 128B 8x8).
    K-major: an atom row holds consecutive k of one mn; rows are consecutive mn. The stride dimension byte offset
    (SBO) steps 8 mn; the leading dimension byte offset (LBO) steps 8 k between core matrices when unswizzled, and is
    unused when swizzled (a k16 slice fits one swizzled row). MN-major: an atom row holds consecutive mn of one k;
    rows are consecutive k. Unswizzled, SBO steps 8 mn and LBO steps 8 k; swizzled, LBO steps the width / 2 mn of a
    row and SBO steps 8 k."""
    if not mn_major:
        if width == 0:
            return (mn // 8) * sbo + (k // 8) * lbo + (mn % 8) * 16 + (k % 8) * 2
        return (mn // 8) * sbo + (mn % 8) * width + k * 2
    if width == 0:
        return (mn // 8) * sbo + (k // 8) * lbo + (k % 8) * 16 + (mn % 8) * 2
    per_row = width // 2
    return (mn // per_row) * lbo + (k // 8) * sbo + (k % 8) * width + (mn % per_row) * 2


def strides(mn_count, mn_major, width, outer_mn):
    """(LBO, SBO, bytes) of a packed canonical layout of mn_count x 16: the core matrices (or swizzle atoms) along k
    inner and along mn outer, or the other way round (outer_mn False), so that both offsets take values other than
    one atom."""
    if width == 0:
        groups = -(-mn_count // 8)
        inner, outer = 128, 128 * (2 if outer_mn else groups)  # one core matrix; then a row of them
        lbo, sbo = (inner, outer) if outer_mn else (outer, inner)
        return lbo, sbo, 256 * groups
    atom = 8 * width
    if not mn_major:
        groups = -(-mn_count // 8)
        return 16, atom * (2 if outer_mn else 1), atom * groups * (2 if outer_mn else 1)  # LBO unused: 16
    groups = -(-mn_count // (width // 2))
    along_mn, along_k = (2 * atom, atom) if outer_mn else (atom, atom * groups)
    return along_mn, along_k, 2 * atom * groups


class Image:
    """A shared-memory byte image, 0xff (a NaN in both 16-bit types) where nothing is placed."""

    def __init__(self, size):
        self.data = bytearray(b"\xff" * size)
        self.used = set()

    @property
    def bytes(self):
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8)

    def place(self, x, start, mn_major, width, lbo, sbo):
        """Puts the 16-bit x[mn, k] at its swizzled address; no two elements may share one."""
        bits = (x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
        for mn, row in enumerate(bits):
            for k, v in enumerate(row):
                a = swizzled(start + element_offset(mn, k, mn_major, width, lbo, sbo), width)
                assert a not in self.used and a + 2 <= len(self.data), "the test's own layout overlaps"
                self.used.add(a)
                self.data[a], self.data[a + 1] = v & 0xFF, v >> 8


def frag_index(n):
    """The ISA's accumulator fragment of m64nNk16 (f32): thread 32 w + 4 g + t of the warpgroup holds, for j < N / 8,
    d[4j], d[4j+1] = D[16w+g][8j+2t, 8j+2t+1] and d[4j+2], d[4j+3] = D[16w+g+8][8j+2t, 8j+2t+1]. Returns the (row, col)
    index tensors [128, N / 2]."""
    tid = torch.arange(128).view(128, 1)
    i = torch.arange(n // 2).view(1, -1)
    w, g, t = tid // 32, tid % 32 // 4, tid % 4
    j, e = i // 4, i % 4
    return 16 * w + g + 8 * (e // 2), 8 * j + 2 * t + e % 2


def to_frags(d):
    rows, cols = frag_index(d.shape[1])
    return d[rows, cols].float().contiguous()


def from_frags(f):
    rows, cols = frag_index(2 * f.shape[1])
    d = torch.full((64, 2 * f.shape[1]), float("nan"))
    d[rows, cols] = f
    return d


def a_registers(a):
    """The ISA's A register fragment of m64nNk16 (16-bit): thread 32 w + 4 g + t holds the mma.m16n8k16 A fragment
    of rows 16w .. 16w + 15: {A[r][2t], A[r][2t+1]}, {A[r+8][2t], ..}, {A[r][2t+8], ..}, {A[r+8][2t+8], ..} with r =
    16w + g, the lower k in the low half. Returns int32 [128, 4]."""
    bits = a.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    tid = torch.arange(128)
    r, t = 16 * (tid // 32) + tid % 32 // 4, tid % 4
    regs = []
    for dr, dk in ((0, 0), (8, 0), (0, 8), (8, 8)):
        lo, hi = bits[r + dr, 2 * t + dk], bits[r + dr, 2 * t + dk + 1]
        regs.append(lo | hi << 16)
    out = torch.stack(regs, 1)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def run(simt_ops, image, steps, waits, n, dtype, trans_a, trans_b, a_regs=None, c=None, misuse=0):
    """The op on `steps` [(desc_a, desc_b, acc, scale_d, commit)]; returns [len(waits), 2, 64, N] (D per wait and
    accumulator, from the fragments)."""
    descs = torch.tensor([[s[0], s[1]] for s in steps], dtype=torch.int64)
    info = torch.tensor([[s[2], s[3], int(s[4])] for s in steps], dtype=torch.int32)
    c = torch.full((2, 128, n // 2), float("nan")) if c is None else c
    out = simt_ops.wgmma(image.bytes, descs, info, torch.tensor(waits, dtype=torch.int32), n, DTYPES[dtype], trans_a,
                         trans_b, a_regs, c, misuse)
    assert out.shape == (len(waits), 2, 128, n // 2)
    return torch.stack([torch.stack([from_frags(out[w, x]) for x in range(2)]) for w in range(len(waits))])


def assert_product(got, a, b, c=None):
    want = a.double() @ b.double() + (0 if c is None else c.double())
    scale = (a.double().abs() @ b.double().abs()).max() + (0 if c is None else c.abs().max())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(scale))


def operands(n, dtype, gen, k=16):
    a = torch.randn(64, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    return a, b


def layout(image, x_mn_k, start, mn_major, swizzle, outer_mn):
    """Places x [mn, 16] at start in the given layout; returns its descriptor."""
    mode, width = SWIZZLES[swizzle]
    lbo, sbo, _ = strides(x_mn_k.shape[0], mn_major, width, outer_mn)
    image.place(x_mn_k, start, mn_major, width, lbo, sbo)
    return descriptor(start, lbo, sbo, mode)


def region(mn_count, mn_major, swizzle, outer_mn):
    _, width = SWIZZLES[swizzle]
    return -(-strides(mn_count, mn_major, width, outer_mn)[2] // 1024) * 1024


def build(a, b, a_layout, b_layout):
    """An image holding A (64 x 16) and B (16 x N) in the layouts (mn_major, swizzle, outer_mn), A's None when it is
    not in shared memory, B after A on a 1024-byte boundary. Returns (image, desc_a, desc_b)."""
    a_bytes = region(64, *a_layout) if a_layout else 0
    image = Image(a_bytes + region(b.shape[1], *b_layout))
    desc_a = layout(image, a, 0, *a_layout) if a_layout else 0
    return image, desc_a, layout(image, b.t(), a_bytes, *b_layout)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [8, 64, 256])
@pytest.mark.parametrize("b_major", ["K", "MN"])
@pytest.mark.parametrize("swizzle", list(SWIZZLES))
@pytest.mark.parametrize("a_source", ["smem K", "smem MN", "registers"])
def test_wgmma_reads_the_isa_layouts(simt_ops, a_source, swizzle, b_major, n, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{a_source} {swizzle} {b_major} {n} {dtype}".encode()))
    a, b = operands(n, dtype, gen)
    outer = bool(torch.randint(0, 2, (1,), generator=gen))  # which way round A packs its atoms (B the other)
    a_mn_major = a_source == "smem MN"
    a_layout = None if a_source == "registers" else (a_mn_major, swizzle, outer)
    image, desc_a, desc_b = build(a, b, a_layout, (b_major == "MN", swizzle, not outer))
    regs = a_registers(a).unsqueeze(0) if a_source == "registers" else None
    got = run(simt_ops, image, [(desc_a, desc_b, 0, 0, True)], [0], n, dtype, a_mn_major, b_major == "MN", regs)
    assert_product(got[0, 0], a, b)
    assert torch.isnan(got[0, 1]).all(), "the other accumulator keeps its (NaN) start"


@pytest.mark.parametrize("n", [24, 136])
@pytest.mark.parametrize("b_major", ["K", "MN"])
@pytest.mark.parametrize("swizzle", list(SWIZZLES))
def test_wgmma_n_not_a_power_of_two(simt_ops, swizzle, b_major, n):
    gen = torch.Generator().manual_seed(n * 7 + len(swizzle) + len(b_major))
    a, b = operands(n, torch.bfloat16, gen)
    image, desc_a, desc_b = build(a, b, (False, swizzle, True), (b_major == "MN", swizzle, False))
    got = run(simt_ops, image, [(desc_a, desc_b, 0, 0, True)], [0], n, torch.bfloat16, False, b_major == "MN")
    assert_product(got[0, 0], a, b)


@pytest.mark.parametrize("scale_d", [0, 1])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_wgmma_scale_d_adds_the_accumulators(simt_ops, scale_d, dtype):
    gen = torch.Generator().manual_seed(11 + scale_d)
    a, b = operands(64, dtype, gen)
    c = torch.randn(64, 64, generator=gen) * 4
    image, desc_a, desc_b = build(a, b, (False, "128B", False), (True, "64B", True))
    start = torch.stack([to_frags(c), torch.zeros(128, 32)])
    got = run(simt_ops, image, [(desc_a, desc_b, 0, scale_d, True)], [0], 64, dtype, False, True, c=start)
    assert_product(got[0, 0], a, b, c if scale_d else None)
    assert torch.equal(got[0, 1], torch.zeros(64, 64)), "an accumulator no wgmma names is left alone"


def k32_image(n, dtype, gen):
    """A 64 x 32 and B 32 x n, K-major with 128-byte swizzle (a 128-byte row holds 64 k): the second k16 step's
    descriptors start 32 bytes into the rows, as kernels step k inside a swizzle atom."""
    a, b = operands(n, dtype, gen, k=32)
    b_at = 8 * 1024
    image = Image(b_at + (n // 8) * 1024)
    image.place(a, 0, False, 128, 16, 1024)
    image.place(b.t(), b_at, False, 128, 16, 1024)
    descs = [(descriptor(32 * s, 16, 1024, 1), descriptor(b_at + 32 * s, 16, 1024, 1)) for s in range(2)]
    return image, a, b, descs


@pytest.mark.parametrize("commit_each", [False, True])
def test_wgmma_k32_as_two_chained_k16_steps(simt_ops, commit_each):
    """Two wgmmas on one accumulator, in one commit group or two, retired by one wait: the second takes the first's
    result as C (the ISA orders wgmmas of one shape on the same accumulators)."""
    gen = torch.Generator().manual_seed(5 + commit_each)
    image, a, b, descs = k32_image(64, torch.bfloat16, gen)
    steps = [(*descs[0], 0, 0, commit_each), (*descs[1], 0, 1, True)]
    got = run(simt_ops, image, steps, [0], 64, torch.bfloat16, False, False)
    assert_product(got[0, 0], a, b)


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:3"])
def test_wgmma_wait_group_retires_the_older_groups(simt_ops, monkeypatch, schedule):
    """Group 1 accumulates k 0..31 into accumulator 0, group 2 the first k16 step into accumulator 1. wait_group 1
    retires group 1 only: accumulator 0 is done, accumulator 1 still in flight (its registers read as NaN);
    wait_group 0 then retires group 2. In any order of the threads (the warpgroup's queue is thread 0's to change)."""
    monkeypatch.setenv("DCP_SIMT_SCHEDULE", schedule)
    gen = torch.Generator().manual_seed(8)
    image, a, b, descs = k32_image(128, torch.float16, gen)
    steps = [(*descs[0], 0, 0, False), (*descs[1], 0, 1, True), (*descs[0], 1, 0, True)]
    got = run(simt_ops, image, steps, [1, 0], 128, torch.float16, False, False)
    assert_product(got[0, 0], a, b)
    assert torch.isnan(got[0, 1]).all()
    assert_product(got[1, 0], a, b)
    assert_product(got[1, 1], a[:, :16], b[:16])


@pytest.mark.parametrize("misuse", [1, 2, 3])
def test_wgmma_misuse_gives_a_wrong_answer(simt_ops, misuse):
    """Between the issue and the wait: 1 overwrites the operands in shared memory, 2 reads the accumulators, 3 adds
    to them. The executor reads the operands at the wait, poisons the accumulators in flight and retires a changed
    one as NaN, so each gives a wrong answer where the same kernel without the misuse is right."""
    gen = torch.Generator().manual_seed(30 + misuse)
    a, b = operands(64, torch.bfloat16, gen)
    c = torch.randn(64, 64, generator=gen)
    image, desc_a, desc_b = build(a, b, (False, "32B", True), (False, "none", False))
    steps = [(desc_a, desc_b, 0, 1, True)]
    start = torch.stack([to_frags(c), torch.zeros(128, 32)])
    good = run(simt_ops, image, steps, [0], 64, torch.bfloat16, False, False, c=start)
    assert_product(good[0, 0], a, b, c)
    bad = run(simt_ops, image, steps, [0], 64, torch.bfloat16, False, False, c=start, misuse=misuse)[0, 0]
    want = (a.double() @ b.double() + c.double()).float()
    assert not torch.allclose(bad, want, rtol=1e-3, atol=1e-3)
    if misuse == 1:  # the operands read at the wait are the zeros written after the issue
        torch.testing.assert_close(bad, c)
    else:
        assert torch.isnan(bad).all()


def one_step():
    """A one-wgmma case (n 8, fp16, no swizzle) in a 3072-byte image: A at 0, B at 2048."""
    gen = torch.Generator().manual_seed(3)
    image, desc_a, desc_b = build(*operands(8, torch.float16, gen), (False, "none", True), (False, "none", True))
    assert len(image.data) == 3072
    return image, [(desc_a, desc_b, 0, 0, True)]


def test_wgmma_without_a_fence_is_refused(simt_ops):
    image, steps = one_step()
    with pytest.raises(RuntimeError, match="without a wgmma.fence"):
        run(simt_ops, image, steps, [0], 8, torch.float16, False, False, misuse=4)


def test_wgmma_with_an_exited_thread_is_refused(simt_ops):
    """.sync.aligned: all 128 threads of the warpgroup; thread 127 returned before the wgmma.fence."""
    image, steps = one_step()
    with pytest.raises(RuntimeError, match="needs all 128 threads of warpgroup 0, but 1 of them exited"):
        run(simt_ops, image, steps, [0], 8, torch.float16, False, False, misuse=5)


@pytest.mark.parametrize("bad,match", [
    (lambda d: descriptor(3072, 128, 256, 0), "outside dynamic shared memory"),      # starts past the image
    (lambda d: descriptor(2048, 1024, 256, 0), "outside dynamic shared memory"),     # its LBO (k 8..15) steps out
    (lambda d: d | 1 << 49, "base offset"),                                         # nonzero matrix base offset
    (lambda d: d | 1 << 60, "reserved bits"),
])
def test_wgmma_refuses_descriptors_it_cannot_follow(simt_ops, bad, match):
    image, steps = one_step()
    steps = [(steps[0][0], bad(steps[0][1]), *steps[0][2:])]
    with pytest.raises(RuntimeError, match=match):
        run(simt_ops, image, steps, [0], 8, torch.float16, False, False)


@pytest.mark.parametrize("swizzle", list(SWIZZLES))
def test_make_smem_desc_encodes_the_isa_fields(simt_ops, swizzle):
    mode, _ = SWIZZLES[swizzle]
    got = simt_ops.wgmma_desc(8192, 1040, mode, 2048, 4096 + 16)
    assert got == descriptor(1040, 2048, 4096 + 16, mode)


@pytest.mark.parametrize("offset,lbo,sbo,match", [
    (8, 16, 16, "16-byte aligned"),
    (16, 24, 16, "16-byte aligned"),
    (16, 16, 8, "16-byte aligned"),
    (8192, 16, 16, "outside dynamic shared memory"),
    (-16, 16, 16, "outside dynamic shared memory"),
    (0, 1 << 18, 16, "14-bit"),
])
def test_make_smem_desc_refuses_what_the_gpu_cannot_address(simt_ops, offset, lbo, sbo, match):
    with pytest.raises(RuntimeError, match=match):
        simt_ops.wgmma_desc(8192, offset, 0, lbo, sbo)
