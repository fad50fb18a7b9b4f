// cp.async.cg.shared.global (16 bytes, src-size zero fill), commit_group and
// wait_group, per thread. Semantics in fagen_emulate/tensor_core.h: the source
// is read at issue (so an out-of-bounds source is reported at the kernel's
// cp_async_16 call), the destination holds garbage until the issuing thread's
// wait retires the copy's group.
#include "runtime_internal.h"

#include <cstring>

namespace fagen_emu {
namespace {

// `site`: where the copy lands (its thread's wait), for racecheck's reports.
void land(const Fiber& fiber, const PendingCopy& copy, SiteCode site) {
  if (instrumenting()) cp_async_landed(thread_ref(fiber), copy.destination, site);
  std::memcpy(copy.destination, copy.data, sizeof copy.data);
}

// Lands, in issue order, every copy of a group numbered below
// `first_kept_group`; the others stay in flight.
void land_groups_before(Fiber& fiber, uint32_t first_kept_group, SiteCode site) {
  std::size_t kept = 0;
  for (std::size_t i = 0; i < fiber.copies.size(); ++i) {
    const PendingCopy& copy = fiber.copies[i];
    if (copy.group < first_kept_group) {
      land(fiber, copy, site);
    } else {
      fiber.copies[kept++] = copy;
    }
  }
  fiber.copies.resize(kept);
}

}  // namespace

void cp_async_16(void* shared_dst, const void* global_src, int src_bytes, Site site) {
  Fiber& fiber = *current_fiber;
  if (src_bytes < 0 || src_bytes > 16) fail(site, "cp.async with src-size %d: it must be in [0, 16]", src_bytes);
  if (reinterpret_cast<uintptr_t>(shared_dst) % 16 != 0) {
    fail(site, "cp.async destination %p is not 16-byte aligned", shared_dst);
  }
  if (reinterpret_cast<uintptr_t>(global_src) % 16 != 0) {
    fail(site, "cp.async source %p is not 16-byte aligned", global_src);
  }
  check_dynamic_shared_range(shared_dst, 16, "cp.async", site);
  PendingCopy copy;
  copy.destination = static_cast<unsigned char*>(shared_dst);
  copy.group = fiber.committed_groups;
  copy.site = 0;
  if (instrumenting()) {
    const ThreadRef thread = thread_ref(fiber);
    copy.site = call_site(__builtin_return_address(0), site);
    cp_async_issued(thread, shared_dst, copy.site);
    global_access(thread, global_src, static_cast<std::size_t>(src_bytes), /*write=*/false, /*atomic=*/false,
                  copy.site);
    count_cp_async(src_bytes);
  }
  // src-size 0 reads nothing: a zero-filled chunk may name any address.
  if (src_bytes > 0) std::memcpy(copy.data, global_src, static_cast<std::size_t>(src_bytes));
  std::memset(copy.data + src_bytes, 0, sizeof copy.data - static_cast<std::size_t>(src_bytes));
  std::memset(shared_dst, kGarbageByte, sizeof copy.data);
  fiber.copies.push_back(copy);
}

void cp_async_commit(Site) { current_fiber->committed_groups += 1; }

namespace {

void wait_groups(int pending_groups, Site site, const void* caller) {
  Fiber& fiber = *current_fiber;
  if (pending_groups < 0) fail(site, "cp.async.wait_group %d: the count must be >= 0", pending_groups);
  const uint32_t committed = fiber.committed_groups;
  const uint32_t kept = static_cast<uint32_t>(pending_groups);
  land_groups_before(fiber, committed > kept ? committed - kept : 0, instrumenting() ? call_site(caller, site) : 0);
}

}  // namespace

void cp_async_wait(int pending_groups, Site site) { wait_groups(pending_groups, site, __builtin_return_address(0)); }

void cp_async_wait_all(Site site) {
  cp_async_commit(site);
  wait_groups(0, site, __builtin_return_address(0));
}

void land_all_copies(Fiber& fiber) {
  for (const PendingCopy& copy : fiber.copies) land(fiber, copy, copy.site);
  fiber.copies.clear();
}

}  // namespace fagen_emu
