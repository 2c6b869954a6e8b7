// Bad indices read from device arrays, reported instead of followed (rtcinfer/errors.py).
//   A kernel that takes page ids or positions from device memory checks each one against its
//   valid range [0, limit) before using it; a bad one is skipped (no memory is touched through
//   it) and counted in a per-device record. The first one counted since the record was cleared
//   is described there and copied to a record in pinned host memory (mapped into the device's
//   address space), count last: the host reads that copy before its next call, without a sync.
// Prelude: the BadIndex enum (which array held the entry), generated from rtcinfer/errors.py.
#pragma once

struct alignas(8) BadIndexRecord {
  int count;   // rows with a bad entry since the record was cleared (the host copy: 0 or 1)
  int code;    // a BadIndex: which array held the first one
  int index;   // its index in that array (8-byte aligned: index and value are stored as a pair)
  int value;   // what it held
  int limit;   // the bound it broke: valid entries lie in [0, limit)
  int unused[3];  // to 32 bytes
};

// x clamped into int's range (what a record holds of a 64-bit index or bound).
RTC_DEVICE int saturate_int(int64_t x) {
  constexpr int64_t HI = 0x7fffffff, LO = -HI - 1;
  return static_cast<int>(x > HI ? HI : (x < LO ? LO : x));
}

// Count one bad entry in `record` (device memory); the first since the record was cleared also
// describes it there and in `host_copy` (pinned host memory), whose count is written last.
RTC_DEVICE void report_bad_index(BadIndexRecord* record, BadIndexRecord* host_copy, BadIndex code,
                                 int index, int value, int limit) {
  if (atomicAdd(&record->count, 1) != 0) return;
  record->code = host_copy->code = static_cast<int>(code);
  record->index = host_copy->index = index;
  record->value = host_copy->value = value;
  record->limit = host_copy->limit = limit;
  __threadfence_system();  // the description reaches the host before the count that flags it
  *reinterpret_cast<volatile int*>(&host_copy->count) = 1;
}

// Describe a bad entry without counting it, for a kernel that must not hold an atomic: in the
// RoPE kernel one (or a volatile store) made ptxas cap its registers and spill (sm_80). Plain
// stores, index and value as one 8-byte store so that they stay a pair when several threads
// write; the last writer's entry is described, and the count says "at least one".
RTC_DEVICE void note_bad_index(BadIndexRecord* record, BadIndexRecord* host_copy, BadIndex code,
                               int index, int value, int limit) {
  BadIndexRecord* const records[2] = {record, host_copy};
  for (BadIndexRecord* r : records) {
    r->code = static_cast<int>(code);
    r->limit = limit;
    *reinterpret_cast<int2*>(&r->index) = make_int2(index, value);
  }
  if (record->count == 0) record->count = 1;
  __threadfence_system();  // the description reaches the host before the count that flags it
  host_copy->count = 1;
}
