// Bad indices read from device arrays, reported instead of followed (rtcinfer/errors.py).
//   A kernel that takes page ids or positions from device memory checks each one against its
//   valid range [0, limit) before using it; a bad one is skipped (no memory is touched through
//   it) and counted in a per-device record. The first one counted since the record was cleared
//   is described there and copied to a record in pinned host memory (mapped into the device's
//   address space), count last: the host reads that copy before its next call, without a sync.
// Prelude: the BadIndex enum (which array held the entry), generated from rtcinfer/errors.py.
#pragma once

struct BadIndexRecord {
  int count;   // rows with a bad entry since the record was cleared (the host copy: 0 or 1)
  int code;    // a BadIndex: which array held the first one
  int index;   // its index in that array
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
