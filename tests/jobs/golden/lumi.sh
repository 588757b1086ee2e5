#!/bin/bash
#SBATCH --job-name=llama-8b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=56
#SBATCH --mem=0
#SBATCH --partition=standard-g
#SBATCH --account=project_465000001
#SBATCH --time=2-00:00:00
#SBATCH --hint=nomultithread
#SBATCH --exclusive
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output="/scratch/project_465000001/maester/jobs/llama-8b/logs/%j.out"
#SBATCH --error="/scratch/project_465000001/maester/jobs/llama-8b/logs/%j.err"

# The container's access to the Slingshot network (libfabric/CXI): without these binds RCCL falls back to TCP
# sockets (the LUMI AI guide loads the same module).
module use /appl/local/laifs/modules
module load lumi-aif-singularity-bindings
# RCCL over the Slingshot interconnect (the four hsn NICs); host collectives (gloo) over the first of them.
export NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3
export GLOO_SOCKET_IFNAME=hsn0
export NCCL_NET_GDR_LEVEL=PHB
export FI_CXI_DISABLE_CQ_HUGETLB=1
# DataLoader workers fork after RCCL/libfabric set up: keep the CXI provider's memory registrations fork-safe.
export CXI_FORK_SAFE=1
export CXI_FORK_SAFE_HP=1
# MIOpen caches on each node's local disk, not the shared filesystem; MIOpen does not create the directory, so
# every node makes it, in the container that uses it.
export MIOPEN_USER_DB_PATH="/tmp/${USER}-miopen-${SLURM_JOB_ID}"
export MIOPEN_CUSTOM_CACHE_DIR="$MIOPEN_USER_DB_PATH"
export OMP_NUM_THREADS=7
# On whole nodes torchrun binds each rank to the CPU cores next to its GCD (--numa-binding), through numactl,
# which the container image must have (LUMI's AI containers do): checked on every node before training starts.
srun --ntasks-per-node=1 singularity exec --bind=/scratch/project_465000001/maester --bind=/scratch/project_465000001/maester/jobs/llama-8b --bind=/scratch/project_465000001 --bind=/flash/project_465000001 /appl/local/containers/rocm-pytorch.sif bash -c 'mkdir -p "$MIOPEN_USER_DB_PATH" && { command -v numactl >/dev/null || { echo "numactl is not in the container image on $(hostname): torchrun --numa-binding needs it" >&2; exit 2; }; }' || exit 2

set -uo pipefail
JOB_DIR=/scratch/project_465000001/maester/jobs/llama-8b
cd /scratch/project_465000001/maester
ln -sfn "${SLURM_JOB_ID}.out" "$JOB_DIR/logs/latest.out"
ln -sfn "${SLURM_JOB_ID}.err" "$JOB_DIR/logs/latest.err"
echo "[$(date '+%F %T')] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"


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
srun --kill-on-bad-exit=1 singularity exec --bind=/scratch/project_465000001/maester --bind=/scratch/project_465000001/maester/jobs/llama-8b --bind=/scratch/project_465000001 --bind=/flash/project_465000001 /appl/local/containers/rocm-pytorch.sif /opt/venv/bin/python -m maester.jobs.torchrun \
  --nnodes="$SLURM_NNODES" --nproc_per_node=8 --numa-binding=exclusive \
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

