// A work item of the batch decode plan (decode.cu reads them; attention/decode_plan.py and
// decode_plan.cu write them by these names): a chunk of one request's tokens and the request's
// merge group.
#pragma once

struct alignas(16) DecodeWorkItem {
  int request;      // batch row
  int token_begin;  // the chunk: tokens [token_begin, token_end) of the request
  int token_end;
  int kv_len;       // the request's length (its query sits at position kv_len - 1)
  int page_ids;     // where the request's page ids start in the plan (ints)
  int merge_begin;  // the request's first item (its partials are merged in item order)
  int merge_count;  // items of the request; 1: the chunk is the whole request, written directly
  int unused;
};
