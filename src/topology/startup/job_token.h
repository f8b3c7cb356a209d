// The job token's arithmetic: fresh nonces, and proofs that a node holds the
// token (HMAC-SHA256, OpenSSL) without sending it.
#pragma once

#include <string>

namespace gradagg::detail {

// `bytes` bytes from the kernel's random source (getrandom), as hex.
std::string randomHex(int bytes);

// HMAC-SHA256(token, message) as hex; "-" when there is no token, so a node
// with a token and one without disagree like two different tokens.
std::string proofOf(const std::string& token, const std::string& message);

// a == b in a time that does not depend on where they differ.
bool sameProof(const std::string& a, const std::string& b) noexcept;

}  // namespace gradagg::detail
