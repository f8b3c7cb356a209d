#include "topology/startup/job_token.h"

#include <sys/random.h>

#include <cerrno>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

namespace gradagg::detail {

namespace {
std::string hex(const unsigned char* p, std::size_t n) {
  std::string out;
  out.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) out += fmt::format("{:02x}", p[i]);
  return out;
}
}  // namespace

std::string randomHex(int bytes) {
  std::vector<unsigned char> buf(static_cast<std::size_t>(bytes));
  std::size_t got = 0;
  while (got < buf.size()) {
    const ssize_t r = ::getrandom(buf.data() + got, buf.size() - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw std::system_error(errno, std::generic_category(), "gradagg: getrandom");
    got += static_cast<std::size_t>(r);
  }
  return hex(buf.data(), buf.size());
}

std::string proofOf(const std::string& token, const std::string& message) {
  if (token.empty()) return "-";
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (::HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
             reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
             &len) == nullptr)
    throw std::runtime_error("gradagg: HMAC-SHA256 failed");
  return hex(mac, len);
}

bool sameProof(const std::string& a, const std::string& b) noexcept {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace gradagg::detail
