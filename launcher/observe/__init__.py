"""What a run shows and how it is watched: metrics and their sinks (metrics), each rank's log
(ranklog), the hang watchdog (watchdog), the profiler (profiling) and host memory readings
(host_memory). It imports only the launcher root (config, timeouts): the loop calls it, it
never calls the loop."""
