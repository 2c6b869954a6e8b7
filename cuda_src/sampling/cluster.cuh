// Thread-block clusters (sm_90+): the CTA's rank, cluster-wide barriers and distributed shared
// memory. A shared variable of another CTA of the cluster is reached by mapping this CTA's
// shared address of the same variable to that rank (mapa), then ld/st.shared::cluster.
#pragma once

RTC_DEVICE uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

RTC_DEVICE uint32_t cluster_index() {  // the cluster's index in a 1-D grid of clusters
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster: shared-memory writes made before the barrier are
// visible to every CTA of the cluster after it.
RTC_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}

// The shared::cluster address of `local` (a variable of this CTA) in CTA `rank`.
template <typename T>
RTC_DEVICE uint32_t remote(const T* local, uint32_t rank) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}

RTC_DEVICE uint32_t load_remote_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

RTC_DEVICE uint64_t load_remote_u64(uint32_t addr) {
  uint64_t v;
  asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(addr) : "memory");
  return v;
}

RTC_DEVICE float load_remote_f32(uint32_t addr) { return __uint_as_float(load_remote_u32(addr)); }

RTC_DEVICE void store_remote_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

RTC_DEVICE uint32_t atomic_add_remote_u32(uint32_t addr, uint32_t v) {
  uint32_t old;
  asm volatile("atom.shared::cluster.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "r"(addr), "r"(v)
               : "memory");
  return old;
}
