//! Why a task request failed, and the one mapping of that onto ttrpc's codes.

use containerd_shim::protos::ttrpc::{self, Code};

use super::options::OptionsError;
use super::vgpu::VgpuError;

/// A failed task request. containerd shows the message to the user (`ctr: ...`), and clients
/// (containerd's own, the kubelet) match on its code and on some of its words, so both follow
/// containerd's runc shim: errdefs' suffixes (`: not found`, `: failed precondition`,
/// `: already exists`) and runc's prefixes (`OCI runtime exec failed: ...`).
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// No such container or process.
    #[error("{0}: not found")]
    NotFound(String),
    /// The request does not fit the process's state (errdefs' failed precondition).
    #[error("{0}: failed precondition")]
    Precondition(String),
    /// An id in use already.
    #[error("{0}: already exists")]
    AlreadyExists(String),
    /// A state the runc shim refuses without an errdefs code ("cannot delete a running
    /// process"): ttrpc's unknown.
    #[error("{0}")]
    State(String),
    /// A malformed request.
    #[error("{0}")]
    Invalid(String),
    /// Runtime options that cannot be used.
    #[error(transparent)]
    Options(#[from] OptionsError),
    /// runc failed: `what` is containerd's prefix for the operation (`OCI runtime create
    /// failed`), `why` what runc logged.
    #[error("{what}: {why}")]
    Runc {
        /// The operation, as containerd's runc shim says it failed.
        what: &'static str,
        /// What runc said.
        why: String,
    },
    /// runc failed where containerd's runc shim passes runc's own words on (ps, update).
    #[error("{0}")]
    RuncSaid(String),
    /// The vGPU could not be given (a bad annotation, no GPU that fits, no node service).
    #[error("gpuplex: {0}")]
    Vgpu(#[from] VgpuError),
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
        #[source]
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
            TaskError::AlreadyExists(_) => Code::ALREADY_EXISTS,
            TaskError::Precondition(_) | TaskError::FrozenMeanwhile(_) => Code::FAILED_PRECONDITION,
            TaskError::Invalid(_) | TaskError::Options(_) | TaskError::Vgpu(_) => {
                Code::INVALID_ARGUMENT
            }
            TaskError::Runc { .. }
            | TaskError::RuncSaid(_)
            | TaskError::State(_)
            | TaskError::Io { .. } => Code::UNKNOWN,
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
        let (code, message) = status(TaskError::Vgpu(VgpuError::Refused(
            gpuplex_hook::stages::HookError {
                stage: gpuplex_wire::stage::Stage::ShimCreate,
                message: "gpuplex.io/weight: 0 is not in 1..=100".into(),
            },
        )));
        assert_eq!(code, Code::INVALID_ARGUMENT);
        assert!(
            message.starts_with("gpuplex: gpuplex.io/weight"),
            "{message}"
        );
        assert_eq!(
            status(TaskError::Precondition("process not created".into())),
            (
                Code::FAILED_PRECONDITION,
                "process not created: failed precondition".into()
            )
        );
        assert_eq!(
            status(TaskError::AlreadyExists("id e1".into())),
            (Code::ALREADY_EXISTS, "id e1: already exists".into())
        );
        let (code, message) = status(TaskError::Runc {
            what: "OCI runtime exec failed",
            why: "exec failed: unable to start container process".into(),
        });
        assert_eq!(code, Code::UNKNOWN);
        assert_eq!(
            message,
            "OCI runtime exec failed: exec failed: unable to start container process"
        );
    }
}
