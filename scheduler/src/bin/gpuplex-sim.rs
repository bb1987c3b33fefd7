//! `gpuplex-sim`: replays a scenario against gpuplex's scheduler in virtual time.
//!
//! Exit codes: 0 success (also when stdout is closed early), 1 a file could not be read or the
//! output written, 2 a usage error or a bad scenario. Errors are one line on stderr, prefixed
//! `gpuplex-sim: `.

use std::io::{self, Write};
use std::process::ExitCode;
use std::time::Duration;

use gpuplex_scheduler::sim::{self, Scenario, Timeline};
use gpuplex_scheduler::time::parse_duration;

const USAGE: &str = "\
gpuplex-sim: replay a scenario of GPUs and containers against gpuplex's scheduler, in virtual time

usage:
  gpuplex-sim SCENARIO.toml                                print the report as JSON
  gpuplex-sim --timeline [--resolution 100ms] SCENARIO.toml  draw who used each GPU when
  gpuplex-sim --help                                       print this help

options:
  --timeline        print a text timeline and a share table instead of the JSON report
  --resolution D    the time one timeline column stands for (default: a hundredth of the
                    scenario's duration, to the millisecond)

The same scenario and seed always give the same output. Scenario format: see
scheduler/scenarios/*.toml. Exit codes: 0 ok, 1 I/O error, 2 usage error or bad scenario.
";

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
enum Command {
    Help,
    Report {
        path: String,
    },
    Timeline {
        path: String,
        resolution: Option<Duration>,
    },
}

/// A failure: its one-line message and the exit code.
struct Failure {
    message: String,
    code: u8,
}

fn usage_error(message: String) -> Failure {
    Failure {
        message: format!("{message}; run `gpuplex-sim --help` for usage"),
        code: 2,
    }
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Command, Failure> {
    let mut timeline = false;
    let mut resolution: Option<Duration> = None;
    let mut path: Option<String> = None;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_string(), Some(value.to_string()))
            }
            _ => (arg.clone(), None),
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "--timeline" if inline.is_none() => timeline = true,
            "--resolution" => {
                let value = match inline.or_else(|| args.next()) {
                    Some(value) => value,
                    None => {
                        return Err(usage_error(
                            "--resolution needs a duration, like `--resolution 100ms`".into(),
                        ))
                    }
                };
                let d = parse_duration(&value)
                    .map_err(|e| usage_error(format!("--resolution: {e}")))?;
                if d.is_zero() {
                    return Err(usage_error("--resolution: must be longer than zero".into()));
                }
                resolution = Some(d);
            }
            _ if arg.starts_with('-') && arg != "-" => {
                return Err(usage_error(format!("unknown option `{arg}`")));
            }
            _ => {
                if let Some(first) = &path {
                    return Err(usage_error(format!(
                        "one scenario at a time: got `{first}` and `{arg}`"
                    )));
                }
                path = Some(arg);
            }
        }
    }
    let Some(path) = path else {
        return Err(usage_error("no scenario given".into()));
    };
    if timeline {
        Ok(Command::Timeline { path, resolution })
    } else if resolution.is_some() {
        Err(usage_error(
            "--resolution only applies with --timeline".into(),
        ))
    } else {
        Ok(Command::Report { path })
    }
}

fn load(path: &str) -> Result<Scenario, Failure> {
    let text = std::fs::read_to_string(path).map_err(|e| Failure {
        message: format!("{path}: cannot read the scenario: {e}"),
        code: 1,
    })?;
    Scenario::parse(&text, path).map_err(|e| Failure {
        message: e.to_string(),
        code: 2,
    })
}

fn execute(command: Command) -> Result<String, Failure> {
    let failed = |message: String| Failure { message, code: 1 };
    match command {
        Command::Help => Ok(USAGE.to_string()),
        Command::Report { path } => {
            let scenario = load(&path)?;
            let report = sim::run(&scenario).map_err(|e| failed(format!("{path}: {e}")))?;
            Ok(report.to_json())
        }
        Command::Timeline { path, resolution } => {
            let scenario = load(&path)?;
            let resolution =
                resolution.unwrap_or_else(|| sim::default_resolution(scenario.duration));
            let timeline = Timeline::new(scenario.containers.len(), scenario.duration, resolution)
                .map_err(|e| usage_error(e.to_string()))?;
            let (report, timeline) = sim::run_with_timeline(&scenario, timeline)
                .map_err(|e| failed(format!("{path}: {e}")))?;
            Ok(timeline.render(&scenario, &report))
        }
    }
}

fn main() -> ExitCode {
    let result = parse_args(std::env::args().skip(1)).and_then(execute);
    match result {
        Ok(text) => {
            let mut stdout = io::stdout().lock();
            match stdout
                .write_all(text.as_bytes())
                .and_then(|()| stdout.flush())
            {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gpuplex-sim: cannot write the output: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Err(failure) => {
            eprintln!("gpuplex-sim: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, String> {
        parse_args(args.iter().map(|a| a.to_string())).map_err(|f| {
            assert_eq!(f.code, 2);
            f.message
        })
    }

    #[test]
    fn reads_the_command_line() {
        let report = Command::Report {
            path: "s.toml".into(),
        };
        assert_eq!(parse(&["s.toml"]), Ok(report));
        let timeline = |ms: Option<u64>| Command::Timeline {
            path: "s.toml".into(),
            resolution: ms.map(Duration::from_millis),
        };
        assert_eq!(parse(&["--timeline", "s.toml"]), Ok(timeline(None)));
        assert_eq!(
            parse(&["s.toml", "--timeline", "--resolution", "250ms"]),
            Ok(timeline(Some(250)))
        );
        assert_eq!(
            parse(&["--timeline", "--resolution=1s", "s.toml"]),
            Ok(timeline(Some(1000)))
        );
        assert_eq!(parse(&["x", "--help"]), Ok(Command::Help));
        assert_eq!(parse(&["-h"]), Ok(Command::Help));
    }

    #[test]
    fn usage_errors_say_what_is_wrong() {
        let cases: &[(&[&str], &str)] = &[
            (&[], "no scenario given"),
            (&["a.toml", "b.toml"], "one scenario at a time"),
            (&["--bogus", "a.toml"], "unknown option `--bogus`"),
            (
                &["--timeline=yes", "a.toml"],
                "unknown option `--timeline=yes`",
            ),
            (
                &["--timeline", "a.toml", "--resolution"],
                "--resolution needs a duration",
            ),
            (
                &["--timeline", "--resolution", "fast", "a.toml"],
                "--resolution: `fast` is not a duration",
            ),
            (
                &["--timeline", "--resolution", "0s", "a.toml"],
                "longer than zero",
            ),
            (
                &["--resolution", "1s", "a.toml"],
                "only applies with --timeline",
            ),
        ];
        for (args, expected) in cases {
            let message = parse(args).unwrap_err();
            assert!(message.contains(expected), "{args:?}: {message}");
            assert!(
                message.ends_with("run `gpuplex-sim --help` for usage"),
                "{message}"
            );
            assert!(!message.contains('\n'), "{message}");
        }
    }
}
