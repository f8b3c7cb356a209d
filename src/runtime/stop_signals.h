// What the rest of the library needs to know about gradagg::StopSignals.
#pragma once

namespace gradagg::detail {

// A StopSignals lives and owns SIGINT's handler: the Python module leaves that
// handler alone (its Ctrl-C hook would end the waits with no patience).
bool stopSignalsOwnSigint() noexcept;

}  // namespace gradagg::detail
