"""Online RL with verifiable rewards: answer extraction (answers.py), reward functions (rewards.py), group advantages
(advantages.py), the policy's narrow sampling interface (policy.py) and the rollout source that turns prompts into
scored, packed training microbatches with their sampling log-probabilities (rollout.py)."""
