# What a batch script does once its training step has ended (sourced by the sbatch scripts).
#
#   after_training RC SIGNALLED ITERATIONS RESTARTS MAX_REQUEUES
#
# RC: the step's exit status; SIGNALLED: `limit` when the time limit neared (SIGUSR1 from
# `--signal=B:USR1@N`), `term` when the job got SIGTERM (scancel, preemption), else 0; ITERATIONS: iterations the step completed (lines it added to --loss-log);
# RESTARTS: SLURM_RESTART_COUNT; MAX_REQUEUES: the most requeues for failures. Prints one word:
#   done      the step succeeded: the job ends;
#   stopped   stopped before the time limit with its last iteration saved: requeue (not counted);
#   stalled   the time-limit warning came before a first iteration: each requeue would do the
#             same, so the job ends (give it a longer --time);
#   cancelled stopped by scancel or a preemption (Slurm requeues a preempted job itself if its
#             PreemptMode says so): the job ends;
#   setup     failed before its first iteration: an error of the setup (arguments, PYTHON and
#             its imports, the checkpoint), which would fail the same way again: do not requeue;
#   failed    failed after training a while (a lost node, the restarts ran out): requeue;
#   exhausted failed, and MAX_REQUEUES requeues were spent: the job ends.
# The step's exit status alone cannot tell a setup error: torchrun exits 1 for any failed
# worker, whether that worker exited 2 (megatron_ucp.errors.report) or was killed.
after_training() {
    local rc=$1 signalled=$2 iterations=$3 restarts=$4 max_requeues=$5
    if [ "$signalled" = limit ] && [ "$iterations" -le 0 ]; then echo stalled
    elif [ "$signalled" = limit ]; then echo stopped
    elif [ "$signalled" = term ]; then echo cancelled
    elif [ "$rc" = 0 ]; then echo done
    elif [ "$iterations" -le 0 ]; then echo setup
    elif [ "$restarts" -lt "$max_requeues" ]; then echo failed
    else echo exhausted
    fi
}

# Lines in a file, 0 when it does not exist (the --loss-log before and after a step).
count_lines() {
    if [ -f "$1" ]; then wc -l < "$1"; else echo 0; fi
}
