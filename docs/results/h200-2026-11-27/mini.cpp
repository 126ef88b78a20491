#include <cstring>
#include <sstream>
#include <string>
extern "C" int format_int(int x, char* buf, int n) {
  std::ostringstream s;
  s << "x=" << x;
  const std::string t = s.str();
  std::strncpy(buf, t.c_str(), n);
  return static_cast<int>(t.size());
}
