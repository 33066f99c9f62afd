// CPU work sharing for lazyzero kernels: OpenMP with tasks handed out dynamically.
//
// at::parallel_for gives each thread one equal, static slice. On a machine whose cores are shared
// with other processes (CI runners, a training job's own communication and data-loading threads),
// a thread that is descheduled for one time slice then delays the whole call by that slice.
// With dynamic scheduling of small tasks the threads that run pick up the slack instead.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace lazyzero {

// Calls run(begin, end) on consecutive ranges of at most `grain` items covering [0, total), in
// parallel on torch's intra-op thread count. `run` must not throw.
template <typename Run>
void parallel_for_tasks(int64_t total, int64_t grain, const Run& run) {
  const int64_t tasks = (total + grain - 1) / grain;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
  if (threads <= 1 || at::in_parallel_region()) {
    if (total > 0) run(0, total);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) {
    run(task * grain, std::min(total, (task + 1) * grain));
  }
}

}  // namespace lazyzero
