// Overflow-checked int64 arithmetic for host-side checks on sizes and offsets a
// caller can influence (plan words, tensor strides, ids). Host only.
#pragma once

#include <stdint.h>

#include <limits>

namespace canonical {

// a + b, or false when it overflows int64.
inline bool checked_add(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

// a * b, or false when it overflows int64.
inline bool checked_mul(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// a * b + c, or false when any step overflows int64.
inline bool checked_mul_add(int64_t a, int64_t b, int64_t c, int64_t* out) {
  int64_t product = 0;
  return checked_mul(a, b, &product) && checked_add(product, c, out);
}

// Whether a + b <= limit, without overflow (false when a + b overflows).
inline bool sum_at_most(int64_t a, int64_t b, int64_t limit) {
  int64_t sum = 0;
  return checked_add(a, b, &sum) && sum <= limit;
}

// Pages of `num_rows` rows of `pages_per_row` pages (both >= 0), saturated at
// INT64_MAX: a page id below it names a row below num_rows either way.
inline int64_t pages_in_rows(int64_t num_rows, int64_t pages_per_row) {
  int64_t pages = 0;
  return checked_mul(num_rows, pages_per_row, &pages) ? pages : std::numeric_limits<int64_t>::max();
}

}  // namespace canonical
