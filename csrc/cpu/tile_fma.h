// The FMA tile kernel of paged decode (every ISA level): one KV head's scores over a tile of cache rows by fp32 FMAs,
// and P.V, for any cache type (16-bit and e4m3 rows converted to fp32, exactly). The driver is cpu/paged_decode.cpp.
#pragma once

#include "cpu/level.h"

#include <algorithm>
#include <cstdint>

#include "cpu/gemm.h"

namespace dcp_ops::cpu {
inline namespace DCP_OPS_CPU_LEVEL {  // this ISA level's copy (cpu/level.h)

struct FmaTile {
  int64_t G, Dk, Dv;  // heads per KV head, K and V row widths
  // Small G (GQA): scores by gemm_nt on the query packed by pack_nt. Large G (MLA): by gemm_acc with the heads along
  // the vector, whose Q^T tile is reused over up to a whole tile of rows.
  bool nt;
  // Large G with a 16-bit or e4m3 cache: the score GEMM reads each K element once per column strip of heads and P.V
  // each V element once per block of 6 heads, converting it every time; instead each KV head's tile rows are
  // converted to fp32 once (convert_k: K's, into kf; convert_v: V's, into kf when V is K's rows, else into vf), into
  // buffers that stay in L2 (MLA 128 heads, 32K, bf16: 119 -> 93 ms; 16 heads 13.6 -> 11.5; outputs bitwise the same).
  bool convert_k, convert_v;
  bool v_in_k;  // V rows are the first Dv elements of the K rows

  // Floats of one KV head's packed query.
  int64_t qpack() const { return std::max(packed_nt_size(G, Dk), Dk * G); }

  // One KV head's query (G rows of Dk floats, q_sh apart) packed into qt: for gemm_nt, or as Q^T [Dk x G].
  void pack_query(const float* q, int64_t q_sh, float* qt) const {
    if (nt) {
      pack_nt(G, Dk, q, q_sh, qt);
      return;
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < Dk; ++d) qt[d * G + g] = q[g * q_sh + d];
  }

  // st [n x G] = the n tile rows of K against the packed query qt (base-2 softmax units).
  template <typename T, typename Hook>
  void scores(int64_t n, const RowPtrs<T>& k, const float* qt, float* st, float* kf, Hook& hook) const {
    if (nt) {
      gemm_nt(n, G, Dk, k, qt, st, G, hook);
      return;
    }
    std::fill(st, st + n * G, 0.f);
    const Strided<float> qh{qt, G, 1};
    if (convert_k) {
      for (int64_t i = 0; i < n; ++i) convert_row(k.row(i), Dk, kf + i * Dk);
      gemm_acc(n, G, Dk, Strided<float>{kf, Dk, 1}, qh, st, G, hook);
    } else {
      gemm_acc(n, G, Dk, k, qh, st, G, hook);
    }
  }

  // o [G x Dv] += P V, P = st^T read in place (the tile's probabilities), V the n tile rows (k's when v_in_k).
  template <typename T, typename Hook>
  void pv(int64_t n, const float* st, const RowPtrs<T>& k, const RowPtrs<T>& v, float* o, float* kf, float* vf,
          Hook& hook) const {
    const Strided<float> pt{st, 1, G};
    if (convert_v && v_in_k) {  // V is the first Dv elements of kf's rows; converted here unless scores did
      if (!convert_k)
        for (int64_t i = 0; i < n; ++i) convert_row(k.row(i), Dv, kf + i * Dk);
      gemm_acc(G, Dv, n, pt, Strided<float>{kf, Dk, 1}, o, Dv, hook);
    } else if (convert_v) {
      for (int64_t i = 0; i < n; ++i) convert_row(v.row(i), Dv, vf + i * Dv);
      gemm_acc(G, Dv, n, pt, Strided<float>{vf, Dv, 1}, o, Dv, hook);
    } else {
      gemm_acc(G, Dv, n, pt, v, o, Dv, hook);
    }
  }
};

}  // namespace DCP_OPS_CPU_LEVEL
}  // namespace dcp_ops::cpu
