#!/bin/bash
#SBATCH --job-name=${job_name}
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --output=${job_dir}/logs/%j.out
#SBATCH --error=${job_dir}/logs/%j.err
# A minimal single-node script; edit the resources for your cluster.
set -euo pipefail
cd "${workdir}"
srun torchrun --standalone --nproc_per_node="$${GPUS_PER_NODE:-1}" -m maester train "${job_dir}"
