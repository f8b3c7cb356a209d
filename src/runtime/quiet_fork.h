// Before fork(): let the process's other threads come to rest.
//
// fork() copies every lock as it is, and only the forking thread. glibc takes
// malloc's locks around fork(), so the child can allocate whatever the other
// threads did; GCC 12's AddressSanitizer runtime does not (it intercepts no
// fork): a thread that is being born, dying or inside its allocator at that
// moment leaves a lock held in the child for ever, and the worker never leaves
// 'starting' (seen in CI: a node's worker forked while threads of c10d, gloo
// and InterruptWatch were alive). Threads that are asleep (a condition
// variable, epoll, a futex) hold none of them; one that is running or waiting
// for a CPU may.
#pragma once

#include <chrono>

namespace gradagg::detail {

// How many of this process's other threads are running or runnable now
// (/proc/self/task/*/stat, state R); 0 when /proc cannot be read.
int runnableOtherThreads();

// Waits, in slices of 100 us, until no other thread of this process is
// running or runnable, or `most` has passed. Returns whether they came to
// rest. Best effort: a thread that spins longer is forked over, as before.
bool settleOtherThreads(std::chrono::microseconds most);

}  // namespace gradagg::detail
