//! [`Stage`]: where in a container's life a gpuplex program acts on it. The hook's command line
//! names it, its errors start with it (`gpuplex-hook createRuntime: ...`), and the containerd
//! shim's `Create` is one too, so that a line says which program and step failed.

use std::fmt;
use std::str::FromStr;

/// A step of a container's life at which gpuplex acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// podman's `precreate` hook: the proposed `config.json` in, the edited one out.
    Precreate,
    /// The OCI `createRuntime` hook: the container exists, its program has not started.
    CreateRuntime,
    /// The OCI `prestart` hook (runtimes without `createRuntime`): the same moment.
    Prestart,
    /// The OCI `poststop` hook: the container is gone.
    Poststop,
    /// A Kubernetes claim's (or allocation's) CDI attach step, a `createRuntime` hook with the
    /// claim's handle.
    Attach,
    /// The containerd shim's `Create`, which does what the hook does at precreate and
    /// createRuntime itself.
    ShimCreate,
}

impl Stage {
    /// The stages `gpuplex-hook` runs at, as its command line names them.
    pub const OF_THE_HOOK: [Stage; 5] = [
        Stage::Precreate,
        Stage::CreateRuntime,
        Stage::Prestart,
        Stage::Poststop,
        Stage::Attach,
    ];

    /// The stage's name: the OCI hook name (`createRuntime`), podman's (`precreate`), or the
    /// shim's `create`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Precreate => "precreate",
            Stage::CreateRuntime => "createRuntime",
            Stage::Prestart => "prestart",
            Stage::Poststop => "poststop",
            Stage::Attach => "attach",
            Stage::ShimCreate => "create",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is no stage `gpuplex-hook` runs at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown stage {0:?}: expected precreate, createRuntime, prestart, poststop or attach")]
pub struct UnknownStage(pub String);

/// The hook's stages by name; `createruntime` too, as podman's hooks.d lower-cases it. The
/// shim's `create` is not one of them.
impl FromStr for Stage {
    type Err = UnknownStage;
    fn from_str(name: &str) -> Result<Stage, UnknownStage> {
        let name = if name == "createruntime" {
            "createRuntime"
        } else {
            name
        };
        Stage::OF_THE_HOOK
            .into_iter()
            .find(|stage| stage.as_str() == name)
            .ok_or_else(|| UnknownStage(name.to_owned()))
    }
}

impl serde::Serialize for Stage {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Stage {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Stage, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_hook_stage_reads_back_from_its_name_and_nothing_else_reads() {
        for stage in Stage::OF_THE_HOOK {
            assert_eq!(stage.to_string().parse(), Ok(stage));
            let json = serde_json::to_string(&stage).unwrap();
            assert_eq!(serde_json::from_str::<Stage>(&json).unwrap(), stage);
        }
        assert_eq!("createruntime".parse(), Ok(Stage::CreateRuntime));
        for name in ["create", "", "CREATERUNTIME", "poststop ", "fail", "../x"] {
            let err = name.parse::<Stage>().unwrap_err().to_string();
            assert!(
                err.starts_with("unknown stage") && !err.contains('\n'),
                "{err}"
            );
        }
        assert_eq!(Stage::ShimCreate.to_string(), "create");
    }
}
