//! `gpuplex-hook [--config PATH] STAGE`: gpuplex's OCI hook (see `gpuplex_hook::stages`).
//!
//! Exit codes: 0 done (or nothing to do), 1 the stage failed (one line on stderr; nothing is left
//! behind), 2 usage.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use caps::{CapSet, Capability, CapsHashSet};
use gpuplex_hook::stages::{self, HookContext};
use gpuplex_wire::config::{config_path, CONFIG_ENV};
use gpuplex_wire::stage::Stage;

const USAGE: &str = "\
usage: gpuplex-hook [--config PATH] precreate|createRuntime|prestart|poststop
       gpuplex-hook [--config PATH] [--socket PATH] attach HANDLE
                                   (a Kubernetes claim's CDI spec: attaches at createRuntime)
       gpuplex-hook fail MESSAGE   (put in a spec by a failed precreate: prints MESSAGE, exits 1)

gpuplex's OCI hook. The runtime runs it and passes the container on stdin: podman's precreate
stage passes the proposed config.json (the edited config is printed on stdout); the OCI stages
pass the container's state. Containers without a gpuplex.io/ annotation are left alone.

  --config PATH   gpuplex.toml, for the node socket (default: $GPUPLEX_CONFIG, else
                  /etc/gpuplex/gpuplex.toml, else /run/gpuplex/gpuplex.sock)
  --socket PATH   the node socket, whatever the configuration says

Exit codes: 0 done, 1 the stage failed (one line on stderr says why), 2 usage.";

/// The capabilities each stage keeps; every other one is dropped as the hook starts.
/// precreate and poststop only talk to the root-owned node socket and write root-owned files:
/// none. createRuntime/prestart may inject a container from outside: entering its mount
/// namespace (SYS_ADMIN, SYS_CHROOT), reading /proc/PID/ns of a non-dumpable process
/// (SYS_PTRACE), creating device nodes (MKNOD), writing its device cgroup (DAC_OVERRIDE).
fn kept(stage: Option<Stage>) -> CapsHashSet {
    match stage {
        Some(Stage::CreateRuntime | Stage::Prestart) => [
            Capability::CAP_SYS_ADMIN,
            Capability::CAP_SYS_CHROOT,
            Capability::CAP_SYS_PTRACE,
            Capability::CAP_MKNOD,
            Capability::CAP_DAC_OVERRIDE,
        ]
        .into_iter()
        .collect(),
        _ => CapsHashSet::new(),
    }
}

/// Drops every capability `stage` does not keep (`None`: the `fail` step, which keeps none).
fn drop_capabilities(stage: Option<Stage>) -> Result<(), String> {
    let keep = kept(stage);
    let have = caps::read(None, CapSet::Permitted).map_err(|e| e.to_string())?;
    let keep: CapsHashSet = keep.intersection(&have).copied().collect();
    caps::clear(None, CapSet::Ambient).map_err(|e| e.to_string())?;
    caps::clear(None, CapSet::Inheritable).map_err(|e| e.to_string())?;
    caps::set(None, CapSet::Effective, &keep).map_err(|e| e.to_string())?;
    caps::set(None, CapSet::Permitted, &keep).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    use lexopt::prelude::*;
    let mut config: Option<PathBuf> = None;
    let mut stage: Option<String> = None;
    let mut fail_message: Option<String> = None;
    let mut socket: Option<PathBuf> = None;
    let mut handle: Option<String> = None;
    let mut parser = lexopt::Parser::from_env();
    loop {
        let arg = match parser.next() {
            Ok(Some(arg)) => arg,
            Ok(None) => break,
            Err(e) => return usage(&e.to_string()),
        };
        match arg {
            Short('h') | Long("help") => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            Long("version") => {
                println!("gpuplex-hook {}", env!("CARGO_PKG_VERSION"));
                return ExitCode::SUCCESS;
            }
            Long("config") => match parser.value() {
                Ok(path) => config = Some(PathBuf::from(path)),
                Err(_) => return usage("--config needs a path"),
            },
            Long("socket") => match parser.value() {
                Ok(path) => socket = Some(PathBuf::from(path)),
                Err(_) => return usage("--socket needs a path"),
            },
            Value(value) if stage.as_deref() == Some("attach") && handle.is_none() => {
                handle = Some(value.to_string_lossy().into_owned());
            }
            Value(value) if stage.is_none() => {
                let value = value.to_string_lossy().into_owned();
                if value == "fail" {
                    // The message is taken as it is, whatever it starts with.
                    let mut rest = match parser.raw_args() {
                        Ok(rest) => rest,
                        Err(e) => return usage(&e.to_string()),
                    };
                    fail_message = rest.next().map(|m| m.to_string_lossy().into_owned());
                    if let Some(extra) = rest.next() {
                        return usage(&format!("unexpected argument {extra:?}"));
                    }
                }
                stage = Some(value);
            }
            other => return usage(&other.unexpected().to_string()),
        }
    }
    let Some(stage) = stage else {
        return usage("no stage given");
    };
    if stage == "fail" {
        // A container whose precreate failed: its runtime runs this at createRuntime, and shows
        // the line podman would have dropped.
        let _ = drop_capabilities(None);
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        eprintln!(
            "{}",
            fail_message.unwrap_or_else(|| "gpuplex-hook: the vGPU could not be set up".into())
        );
        return ExitCode::from(1);
    }
    let stage: Stage = match stage.parse() {
        Ok(stage) => stage,
        Err(e) => return usage(&e.to_string()),
    };
    if stage == Stage::Attach && handle.is_none() {
        return usage("attach needs the claim's handle");
    }
    if let Err(e) = drop_capabilities(Some(stage)) {
        eprintln!("gpuplex-hook {stage}: cannot drop capabilities: {e}");
        return ExitCode::from(1);
    }
    let env = std::env::var_os(CONFIG_ENV);
    let (config, named) = config_path(config.as_deref(), env.as_deref());
    let config = named.then_some(config);
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut input) {
        eprintln!("gpuplex-hook {stage}: cannot read stdin: {e}");
        return ExitCode::from(1);
    }
    if stage != Stage::Attach && !stages::concerns_gpuplex(stage, &input) {
        // Not a gpuplex container: precreate hands the config back as it came.
        if stage == Stage::Precreate {
            let mut out = std::io::stdout();
            if out.write_all(&input).and_then(|()| out.flush()).is_err() {
                return ExitCode::from(1);
            }
        }
        return ExitCode::SUCCESS;
    }
    let context = HookContext::from_config(stage, config.as_deref()).map(|ctx| match socket {
        Some(s) => ctx.with_socket(s),
        None => ctx,
    });
    let result = context.and_then(|ctx| match stage {
        Stage::Precreate => stages::precreate_for_podman(&ctx, &input).and_then(|out| {
            std::io::stdout()
                .write_all(&out)
                .and_then(|()| std::io::stdout().flush())
                .map_err(|e| stages::HookError {
                    stage,
                    message: format!("cannot write the config to stdout: {e}"),
                })
        }),
        Stage::CreateRuntime | Stage::Prestart => stages::create_runtime(&ctx, stage, &input),
        Stage::Attach => stages::attach_claim(&ctx, handle.as_deref().unwrap_or_default(), &input),
        Stage::Poststop => stages::poststop(&ctx, &input),
        // Not a name the command line reads (`Stage::from_str`): the shim's own step.
        Stage::ShimCreate => Err(stages::HookError {
            stage,
            message: "create is the containerd shim's step, not a hook stage".into(),
        }),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}

fn usage(why: &str) -> ExitCode {
    eprintln!("gpuplex-hook: {why}; try gpuplex-hook --help");
    ExitCode::from(2)
}
