// The one error type of the native I/O layer: what failed, on which file, where, and why.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fastdcp {

/// An I/O failure. `errno_value` is the errno of the failed call, or 0 for a logical failure such as
/// a file that ends before the requested bytes. The binding turns it into a Python OSError (or
/// EOFError when errno_value == 0) whose message names the operation, path and offset.
class IoError : public std::runtime_error {
 public:
  IoError(std::string op, std::string path, int64_t offset, size_t nbytes, int errno_value,
          std::string detail = {});

  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] int errno_value() const { return errno_value_; }

 private:
  std::string path_;
  int errno_value_;
};

}  // namespace fastdcp
