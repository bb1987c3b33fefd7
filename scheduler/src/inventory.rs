//! GPUs and assignment.
