// Channel options from Python as "key=value" lines: an integer value is passed as one, any
// other as a string (grpc_server.cc, grpc_calls.cc).
#ifndef PDSERVE_GRPC_OPTIONS_H_
#define PDSERVE_GRPC_OPTIONS_H_

#include <cstdlib>
#include <sstream>
#include <string>

namespace pdserve {

// `set(key, number)` for an integer value, `set(key, text)` for any other.
template <class Set>
void ForEachOption(const char* options, Set set) {
  std::stringstream lines(options);
  for (std::string line; std::getline(lines, line);) {
    auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    char* end = nullptr;
    long number = std::strtol(value.c_str(), &end, 10);
    if (!value.empty() && *end == '\0') {
      set(key, static_cast<int>(number));
    } else {
      set(key, value);
    }
  }
}

}  // namespace pdserve

#endif  // PDSERVE_GRPC_OPTIONS_H_
