// HostHooks: what a runtime that embeds gradagg must do around its forks and
// long waits. The Python module sets them (the GIL, os.register_at_fork
// handlers, buffered sys.stdout, Ctrl-C); a C++ program needs none, and every
// hook is empty by default.
#pragma once

#include <functional>

namespace gradagg::detail {

struct HostHooks {
  std::function<void()> before_fork;        // parent, just before fork()
  std::function<void()> after_fork_parent;  // parent, just after fork() (also when it failed)
  std::function<void()> after_fork_child;   // child, first thing
  std::function<void()> before_child_exit;  // child, before _exit: flush the runtime's buffers
  // Parent, between the slices of every wait for workers (about every 50 ms).
  // Throwing interrupts the wait: the workers are stopped, the owner becomes
  // unusable and the exception propagates (e.g. KeyboardInterrupt).
  std::function<void()> check_interrupt;
  // Parent, as a wait on other nodes begins (topology/): make the host's stop
  // signal reach gradagg::interruptWaits() too (Python: a SIGINT handler that
  // calls it and then Python's own), since those waits sit inside gloo.
  std::function<void()> arm_interrupt;
};

// Call the hooks of these names, if set.
void checkHostInterrupt();
void armHostInterrupt();

// Set once, before the first Aggregator or Population; not thread-safe.
void setHostHooks(HostHooks hooks);
const HostHooks& hostHooks() noexcept;

}  // namespace gradagg::detail
