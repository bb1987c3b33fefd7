//! Why a task request failed, and the one mapping of that onto ttrpc's codes.

use containerd_shim::protos::ttrpc::{self, Code};

use super::options::OptionsError;

/// A failed task request. containerd shows the message to the user (`ctr: ...`).
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// No such container or process.
    #[error("{0}: not found")]
    NotFound(String),
    /// The request does not fit the container's state.
    #[error("{0}")]
    Precondition(String),
    /// A malformed request.
    #[error("{0}")]
    Invalid(String),
    /// Runtime options that cannot be used.
    #[error(transparent)]
    Options(#[from] OptionsError),
    /// runc failed; `why` is what runc logged.
    #[error("runc could not {what}: {why}")]
    Runc {
        /// What the shim asked of runc.
        what: &'static str,
        /// What runc said.
        why: String,
    },
    /// The vGPU could not be given (a bad annotation, no GPU that fits, no node service).
    #[error("gpuplex: {0}")]
    Vgpu(String),
    /// The container was frozen for its next window between the wait for it and `runc exec`;
    /// the exec waits again.
    #[error("{0} was frozen for its next window; try again")]
    FrozenMeanwhile(String),
    /// The shim's own I/O.
    #[error("cannot {what}: {why}")]
    Io {
        /// What the shim was doing.
        what: &'static str,
        /// The error.
        why: std::io::Error,
    },
}

impl TaskError {
    /// An I/O failure while doing `what`.
    pub fn io(what: &'static str, why: std::io::Error) -> TaskError {
        TaskError::Io { what, why }
    }

    fn code(&self) -> Code {
        match self {
            TaskError::NotFound(_) => Code::NOT_FOUND,
            TaskError::Precondition(_) | TaskError::FrozenMeanwhile(_) => Code::FAILED_PRECONDITION,
            TaskError::Invalid(_) | TaskError::Options(_) | TaskError::Vgpu(_) => {
                Code::INVALID_ARGUMENT
            }
            TaskError::Runc { .. } | TaskError::Io { .. } => Code::UNKNOWN,
        }
    }
}

impl From<TaskError> for ttrpc::Error {
    fn from(e: TaskError) -> ttrpc::Error {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_containerds_errdefs() {
        let status = |e: TaskError| match ttrpc::Error::from(e) {
            ttrpc::Error::RpcStatus(s) => (s.code(), s.message().to_owned()),
            other => panic!("not a status: {other:?}"),
        };
        assert_eq!(
            status(TaskError::NotFound("c1".into())),
            (Code::NOT_FOUND, "c1: not found".into())
        );
        let (code, message) = status(TaskError::Vgpu(
            "gpuplex.io/weight: 0 is not in 1..=100".into(),
        ));
        assert_eq!(code, Code::INVALID_ARGUMENT);
        assert!(
            message.starts_with("gpuplex: gpuplex.io/weight"),
            "{message}"
        );
        let (code, _) = status(TaskError::Precondition("c1 is not running".into()));
        assert_eq!(code, Code::FAILED_PRECONDITION);
    }
}
