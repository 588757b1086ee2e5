#!/bin/bash
#SBATCH --job-name=llama-8b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=480G
#SBATCH --partition=gpu
#SBATCH --account=proj42
#SBATCH --time=1-12:00:00
#SBATCH --exclusive
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output="/scratch/project_465000001/maester/jobs/llama-8b/logs/%j.out"
#SBATCH --error="/scratch/project_465000001/maester/jobs/llama-8b/logs/%j.err"
#SBATCH --mail-type=END

set -uo pipefail
JOB_DIR=/scratch/project_465000001/maester/jobs/llama-8b
cd /scratch/project_465000001/maester
ln -sfn "${SLURM_JOB_ID}.out" "$JOB_DIR/logs/latest.out"
ln -sfn "${SLURM_JOB_ID}.err" "$JOB_DIR/logs/latest.err"
echo "[$(date '+%F %T')] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"

module load cuda/12.4
export NCCL_DEBUG=WARN
export HF_HOME='/scratch/hf cache'
source /opt/venv/bin/activate

# torchrun on every node; they meet at the first node (c10d rendezvous). A run whose COMPLETED marker covers
# training.steps (a later link of a chain) exits at once; one whose steps were raised goes on.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
rm -f "$JOB_DIR/stop-requested" "$JOB_DIR/requeue-requested" "$JOB_DIR/failure"

# SLURM's warning before the time limit reaches this shell only: ask the trainer to checkpoint and stop.
trap 'echo "[$(date +%T)] time limit near: asking the trainer to checkpoint"; touch "$JOB_DIR/stop-requested"' USR1

# srun does not inherit sbatch's --cpus-per-task (SLURM 22.05 and later): without this the launcher and all its
# workers share one core.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi

# maester.jobs.torchrun is torchrun that exits with the first failed rank's code, writes it to $JOB_DIR/failure
# and prints one line where torchrun prints a traceback.
srun --kill-on-bad-exit=1 /opt/venv/bin/python -m maester.jobs.torchrun \
  --nnodes="$SLURM_NNODES" --nproc_per_node=4 \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
  -m maester train "$JOB_DIR" &
SRUN_PID=$!
# `wait` returns early when the trapped signal arrives: wait again until srun has ended.
while true; do
  wait "$SRUN_PID"
  status=$?
  kill -0 "$SRUN_PID" 2>/dev/null || break
done

if [ -e "$JOB_DIR/requeue-requested" ]; then
  echo "[$(date +%T)] checkpoint written: requeueing job $SLURM_JOB_ID"
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    echo "scontrol requeue failed: submitting the job script again"
    sbatch "$JOB_DIR/slurm.sh"
  fi
  exit 0
fi
echo "[$(date '+%F %T')] training exited with status $status"
exit "$status"

