"""Before and beside a cluster run: `loomtrain plan` (the memory/FLOPs arithmetic) and
`loomtrain dryrun` (one cluster rank measured on this machine)."""
