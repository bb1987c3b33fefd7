//! The plans of `gpuplexctl install containerd` and `uninstall containerd`: the config read,
//! [`edit`] or [`remove`] applied to its text, and the file changes with the line that says what
//! was done and what to restart.

use std::path::{Path, PathBuf};

use super::{edit, file_version, remove, Entry, Version, RESTART, RUNTIME};
use crate::install::{backup_path, exists, read_text, Change, InstallError, Plan};

/// The plan of `gpuplexctl install containerd`: the config at `config` with gpuplex's entry,
/// after a backup of the original; `containerd` answers `--version` when the file does not say
/// its version.
pub fn plan_install(config: &Path, containerd: &Path) -> Result<Plan, InstallError> {
    let shown = config.display().to_string();
    let target = resolve_link(config);
    let before = read_text(&target)?;
    let in_file = match &before {
        Some(text) => file_version(text).map_err(|e| InstallError::config(&shown, e))?,
        None => None,
    };
    let (version, whence) = match in_file {
        Some(version) => (version, "the file's".to_string()),
        None => {
            let version = containerd_version(containerd, &shown)?;
            (version, format!("from {}", containerd.display()))
        }
    };
    let edit = edit(before.as_deref().unwrap_or(""), version)
        .map_err(|e| InstallError::config(&shown, e))?;
    let v = version.number();
    if !edit.changed() {
        return Ok(Plan::nothing(format!(
            "{shown} already has gpuplex's runtime {RUNTIME} as shipped (config version {v}); nothing changed"
        )));
    }
    let backup = backup_path(config);
    let mut changes = Vec::new();
    let mut kept = String::new();
    if before.is_some() {
        if exists(&backup) {
            kept = format!("; the original stays in {}", backup.display());
        } else {
            changes.push(Change::Backup {
                from: target.clone(),
                to: backup.clone(),
            });
            kept = format!("; the original is kept in {}", backup.display());
        }
    }
    changes.push(Change::Write {
        path: target,
        shown: shown.clone(),
        before: before.clone(),
        after: edit.text.clone(),
    });
    let runc_why = "naming any runtime makes containerd 1.6 and 1.7 drop their built-in runc";
    let (what, would) = match (&before, edit.entry) {
        (None, _) => (
            format!("created {shown} with gpuplex's runtime {RUNTIME}"),
            format!("create {shown} with gpuplex's runtime {RUNTIME}"),
        ),
        (Some(_), Entry::Added) => (
            format!("added gpuplex's runtime {RUNTIME} to {shown}"),
            format!("add gpuplex's runtime {RUNTIME} to {shown}"),
        ),
        (Some(_), Entry::Updated) => (
            format!("updated gpuplex's runtime {RUNTIME} in {shown} to what gpuplex ships"),
            format!("update gpuplex's runtime {RUNTIME} in {shown} to what gpuplex ships"),
        ),
        (Some(_), Entry::Kept) => (
            format!("named runc in {shown} beside gpuplex's runtime {RUNTIME}, as shipped already"),
            format!("name runc in {shown} beside gpuplex's runtime {RUNTIME}, as shipped already"),
        ),
    };
    let mut notes = format!("config version {v}, {whence}");
    if edit.runc_added {
        if edit.entry == Entry::Kept {
            notes.push_str(&format!(": {runc_why}"));
        } else {
            notes.push_str(&format!(", with runc named too: {runc_why}"));
        }
    }
    let would_keep = kept.replace("the original is kept in", "keeping the original in");
    Ok(Plan {
        changes,
        done: format!("{what} ({notes}){kept}; {RESTART}"),
        would: format!("{would} ({notes}){would_keep}"),
        ok: true,
    })
}

/// The plan of `gpuplexctl uninstall containerd`: the original back, byte for byte, when the
/// config is still exactly what install made of it; else gpuplex's entry taken out.
pub fn plan_uninstall(config: &Path) -> Result<Plan, InstallError> {
    let shown = config.display().to_string();
    let target = resolve_link(config);
    let backup = backup_path(config);
    let backup_shown = backup.display().to_string();
    let Some(text) = read_text(&target)? else {
        let left = if exists(&backup) {
            format!(" (its backup {backup_shown} is left as it is)")
        } else {
            String::new()
        };
        return Ok(Plan::nothing(format!(
            "{shown} does not exist; nothing to uninstall{left}"
        )));
    };
    let removed = remove(&text).map_err(|e| InstallError::config(&shown, e))?;
    // The version install wrote; `None` when the file is not one install wrote.
    let written = file_version(&text).ok().flatten();
    let made_from = |original: &str| {
        written.is_some_and(|v| edit(original, v).is_ok_and(|e| e.changed() && e.text == text))
    };
    if let Some(original) = read_text(&backup)? {
        if made_from(&original) {
            return Ok(Plan {
                changes: vec![Change::Restore {
                    backup: backup.clone(),
                    path: target,
                    shown: shown.clone(),
                    before: text,
                    after: original,
                }],
                done: format!("restored {shown} byte for byte from {backup_shown}, which is gone now; {RESTART}"),
                would: format!("restore {shown} byte for byte from {backup_shown} and remove that"),
                ok: true,
            });
        }
        if removed == text {
            return Ok(Plan::nothing(format!(
                "{shown} has no gpuplex runtime; nothing changed ({backup_shown} is left as it is)"
            )));
        }
        return Ok(Plan {
            changes: vec![Change::Write {
                path: target,
                shown: shown.clone(),
                before: Some(text),
                after: removed,
            }],
            done: format!("removed gpuplex's runtime {RUNTIME} from {shown} (it changed since install, so {backup_shown} was not restored and is left as it is); {RESTART}"),
            would: format!("remove gpuplex's runtime {RUNTIME} from {shown} (it changed since install, so {backup_shown} would not be restored)"),
            ok: true,
        });
    }
    if made_from("") {
        return Ok(Plan {
            changes: vec![Change::Remove {
                path: target,
                shown: shown.clone(),
                before: text,
            }],
            done: format!("removed {shown}: install created it and it is unchanged; {RESTART}"),
            would: format!("remove {shown}: install created it and it is unchanged"),
            ok: true,
        });
    }
    if removed == text {
        return Ok(Plan::nothing(format!(
            "{shown} has no gpuplex runtime; nothing changed"
        )));
    }
    Ok(Plan {
        changes: vec![Change::Write {
            path: target,
            shown: shown.clone(),
            before: Some(text),
            after: removed,
        }],
        done: format!("removed gpuplex's runtime {RUNTIME} from {shown}; {RESTART}"),
        would: format!("remove gpuplex's runtime {RUNTIME} from {shown}"),
        ok: true,
    })
}

/// The file a config path names: a symbolic link's target (so that the link stays), else the
/// path itself.
fn resolve_link(path: &Path) -> PathBuf {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => {
            std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
        }
        _ => path.to_path_buf(),
    }
}

/// The config version the installed containerd reads, from `containerd --version`.
fn containerd_version(containerd: &Path, config: &str) -> Result<Version, InstallError> {
    let why = |reason: String| InstallError::ContainerdVersion {
        config: config.to_string(),
        containerd: containerd.display().to_string(),
        reason,
    };
    let output = std::process::Command::new(containerd)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| why(e.to_string()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(why(format!(
            "it exited with {}: {}",
            output.status,
            stderr.lines().next().unwrap_or("").trim()
        )));
    }
    Version::of_containerd(&String::from_utf8_lossy(&output.stdout)).map_err(why)
}
