//! The `governor` binary: the agent and the operator verbs.
use clap::{Parser, Subcommand};
use keyspace_governor::cli::{self, CliError, EXIT_USAGE};
use keyspace_governor::config::{MeasureMode, ValidatedConfig};
use serde::Serialize;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "governor", version, about = "Per-node CPU governor for multi-tenant storage servers")]
struct Cli {
    #[command(subcommand)]
    verb: Verb,
}

#[derive(Subcommand)]
enum Verb {
    /// Run the agent: measurement, shared regions, control socket.
    Agent {
        /// Configuration file; the embedded default when absent.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Measurement backend: auto, ebpf or thread-clock (overrides agent.measure).
        #[arg(long)]
        measure: Option<MeasureMode>,
        /// Control socket path (overrides agent.control-socket).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Where /metrics listens (overrides agent.metrics-addr; port 0: any free port).
        #[arg(long)]
        metrics_addr: Option<std::net::SocketAddr>,
        /// Log as JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Measurement backend and per-keyspace CPU.
    Status {
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Per keyspace CPU (cores over each interval), run-queue wait, window
    /// ratio, bucket fill, debt, ticket waits and refusals, refreshed every
    /// interval like `top`.
    /// `--json` prints one JSON object per frame.
    Top {
        /// Sort by (largest first).
        #[arg(long, value_enum, default_value = "cpu")]
        sort: cli::top::SortKey,
        /// Seconds between frames.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Frames to print, then exit (for scripts); default: until interrupted.
        #[arg(long)]
        iterations: Option<u64>,
        /// Keyspaces shown per frame.
        #[arg(long, default_value_t = 40)]
        limit: usize,
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// One keyspace explained: where its quota comes from, its bucket, debt
    /// and estimate, and why it is or is not throttled now. Exit 1 when the
    /// agent does not know it.
    Keyspace {
        id: u32,
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Registered threads by client process: tid, name, keyspace, CPU.
    Threads {
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Where each keyspace's CPU goes: the kernel samples the stacks of
    /// tagged threads and rule-matched processes on every CPU for
    /// --seconds, by the keyspace each worked for at the sample; symbols
    /// are looked up on the node. Admin role. Build servers with frame
    /// pointers (-C force-frame-pointers=yes) for whole user stacks.
    Profile {
        /// One keyspace (default: every keyspace that ran).
        #[arg(long)]
        keyspace: Option<u32>,
        /// Only the N keyspaces with the most samples.
        #[arg(long, conflicts_with = "keyspace")]
        top: Option<usize>,
        /// How long to sample.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Samples per second on each CPU (1..=1000).
        #[arg(long, default_value_t = 99)]
        frequency: u32,
        /// text (a summary), folded (stacks for flame graph tools), svg (a
        /// flame graph) or pprof (protobuf, for go tool pprof, Pyroscope,
        /// Grafana).
        #[arg(long, value_enum, default_value = "text")]
        format: ProfileFormat,
        /// Write the profile here instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The whole profile as JSON: sample counts by keyspace and stack.
        #[arg(long)]
        json: bool,
    },
    /// Check what this node offers the agent: kernel, BTF, capabilities,
    /// memlock, pid_max, BPF statistics, clocksource, cgroups, scheduler
    /// slices, the agent itself. Exit 1 when the eBPF backend cannot run.
    Doctor {
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Unmodified processes measured by rule: list, add, remove.
    Rules {
        #[command(subcommand)]
        verb: RulesVerb,
    },
    /// Validate, show or change a configuration (a file, or the running agent's).
    Config {
        #[command(subcommand)]
        verb: ConfigVerb,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ProfileFormat {
    Text,
    Folded,
    Svg,
    Pprof,
}

#[derive(Subcommand)]
enum ConfigVerb {
    /// Validate FILE: print the validated configuration, or every error (exit 64).
    /// With --json, one object either way: `valid`, `path`, and `config` and
    /// `warnings`, or `errors`.
    Validate {
        file: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the configuration FILE gives (or the embedded default); with
    /// --socket, the configuration the running agent holds, changes made
    /// online included.
    Show {
        file: Option<PathBuf>,
        #[arg(long, conflicts_with = "file")]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Change one key of the running agent's configuration: KEY=VALUE, the
    /// key dotted (resource-control.cpu-throttle.tenant-max-cpu-ratio=0.25).
    /// The whole configuration is validated again; refused (exit 64) with
    /// every reason, the running one stays. The admin role only (root, the agent's user, access.admins).
    Set {
        assignment: String,
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Make the running agent re-read its --config file (as SIGHUP does);
    /// refused whole (exit 64) with every reason on any error.
    Reload {
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum RulesVerb {
    /// The rules in force, in order (first match wins).
    List {
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Add a rule to the running agent (not to its file), validated with
    /// the whole configuration: refused (exit 64) with every reason. Every
    /// matcher given must hold. The admin role only (root, the agent's user, access.admins).
    Add {
        name: String,
        #[arg(long)]
        keyspace: i64,
        /// cgroup path, exact (v2, or the v1 cpu hierarchy).
        #[arg(long)]
        cgroup: Option<String>,
        /// cgroup path, this or below.
        #[arg(long)]
        cgroup_prefix: Option<String>,
        #[arg(long)]
        tgid: Option<i64>,
        /// Effective uid.
        #[arg(long)]
        uid: Option<i64>,
        /// Executable, absolute path.
        #[arg(long)]
        exe: Option<String>,
        /// Command name prefix (at most 15 bytes).
        #[arg(long)]
        comm_prefix: Option<String>,
        /// Thread name prefix (at most 15 bytes): the rule charges only the
        /// matching process's threads so named.
        #[arg(long)]
        thread_name_prefix: Option<String>,
        /// Cap the rule's --cgroup itself instead of moving its processes
        /// into a cgroup of governor's.
        #[arg(long)]
        cap_in_place: bool,
        /// Insert at this position (0: first) instead of last.
        #[arg(long)]
        position: Option<usize>,
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Remove the rule NAME from the running agent.
    Remove {
        name: String,
        /// The agent's control socket (default /run/governor/governor.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// The socket a verb without `--socket` talks to: `GOVERNOR_SOCKET` when
/// set (an agent whose configuration moved its socket), else the default.
fn default_socket() -> PathBuf {
    match std::env::var_os("GOVERNOR_SOCKET").filter(|s| !s.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => ValidatedConfig::embedded_default().agent().control_socket.clone(),
    }
}

fn print<T: Serialize>(json: bool, value: &T, text: impl FnOnce(&T) -> String) {
    let body = if json { serde_json::to_string_pretty(value).expect("serializable") + "\n" } else { text(value) };
    write_stdout(&body);
}

/// Writes to stdout; a reader that went away (`governor status | head -1`)
/// ends the verb quietly, as it would any Unix filter.
fn write_stdout(body: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(body.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("governor: writing the output: {e}");
        std::process::exit(74); // EX_IOERR
    }
}

fn fail(json: bool, e: &CliError) -> ! {
    if json {
        let body = match e {
            CliError::Config { path, errors } => serde_json::json!({
                "valid": false,
                "path": path,
                "errors": errors.errors.iter().map(|x| serde_json::json!({
                    "key": x.key(), "line": x.line(), "message": x.to_string()
                })).collect::<Vec<_>>(),
            }),
            CliError::Rejected { errors, .. } => serde_json::json!({ "accepted": false, "errors": errors }),
            CliError::Read { path, .. } => serde_json::json!({
                "valid": false, "path": path, "error": keyspace_governor::error_chain(e),
            }),
            other => serde_json::json!({ "error": keyspace_governor::error_chain(other) }),
        };
        write_stdout(&(serde_json::to_string_pretty(&body).expect("json") + "\n"));
    } else {
        eprintln!("governor: {}", keyspace_governor::error_chain(e));
    }
    std::process::exit(e.exit_code())
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            // With --json a usage error is a JSON object on stdout too, as
            // every other error is.
            if code != 0 && std::env::args().skip(1).any(|a| a == "--json") {
                let kind = e.kind();
                let message = e.render().to_string();
                // Its first paragraph, on one line.
                let first: Vec<&str> = message.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
                let first = first.join(" ").trim_start_matches("error: ").to_string();
                write_stdout(
                    &(serde_json::to_string_pretty(
                        &serde_json::json!({ "error": first, "usage": format!("{kind:?}") }),
                    )
                    .expect("json")
                        + "\n"),
                );
            }
            std::process::exit(code);
        }
    };
    match cli.verb {
        Verb::Agent { config, measure, socket, metrics_addr, json } => {
            init_logging(json);
            let cfg = match &config {
                Some(p) => cli::load_config(p).unwrap_or_else(|e| match json {
                    false => fail(false, &e),
                    true => agent_fatal(keyspace_governor::error_chain(&e), e.exit_code()),
                }),
                None => ValidatedConfig::embedded_default(),
            };
            if let Err(e) = run_agent(cfg, config, measure, socket, metrics_addr) {
                // EX_NOPERM when privileges are what is missing.
                use keyspace_governor::agent::AgentError;
                let code = match &e {
                    AgentError::Measure(keyspace_governor::measure::MeasureError::MissingCapability { .. }) => 77,
                    AgentError::Listen { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => 77,
                    _ => 1,
                };
                if json {
                    agent_fatal(keyspace_governor::error_chain(&e), code);
                }
                eprintln!("governor agent: {}", keyspace_governor::error_chain(&e));
                std::process::exit(code);
            }
        }
        Verb::Status { socket, json } => {
            let socket = socket.unwrap_or_else(default_socket);
            match cli::status::run(&socket) {
                Ok(s) => print(json, &s, cli::status::render),
                Err(e) => fail(json, &e),
            }
        }
        Verb::Keyspace { id, socket, json } => match cli::keyspace::run(&socket.unwrap_or_else(default_socket), id) {
            Ok(e) => print(json, &e, cli::keyspace::render),
            Err(e) => fail(json, &e),
        },
        Verb::Top { sort, interval, iterations, limit, socket, json } => {
            if !(0.05..=3600.0).contains(&interval) {
                fail(json, &CliError::Usage(format!("--interval {interval}: between 0.05 and 3600 seconds")));
            }
            if iterations == Some(0) {
                fail(json, &CliError::Usage("--iterations 0 would show nothing: give 1 or more".into()));
            }
            let o = cli::top::Options {
                interval: std::time::Duration::from_secs_f64(interval),
                iterations,
                sort,
                limit,
                json,
            };
            if let Err(e) = cli::top::run(&socket.unwrap_or_else(default_socket), &o, write_stdout) {
                fail(json, &e);
            }
        }
        Verb::Profile { keyspace, top, seconds, frequency, format, output, socket, json } => {
            let ask = cli::profile::Ask { seconds, frequency_hz: frequency, keyspace, top };
            // Refused before sampling, not after it.
            if json && !matches!(format, ProfileFormat::Text) {
                let why = "--json prints the profile as JSON: give it or --format, not both";
                fail(json, &CliError::Usage(why.into()));
            }
            if let Some(dir) = output.as_deref().and_then(|p| p.parent()).filter(|d| !d.as_os_str().is_empty())
                && !dir.is_dir()
            {
                let source = std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory");
                fail(json, &CliError::Write { path: dir.to_path_buf(), source });
            }
            let report = match cli::profile::run(&socket.unwrap_or_else(default_socket), &ask) {
                Ok(r) => r,
                Err(e) => fail(json, &e),
            };
            let body = match (json, format) {
                (true, _) => serde_json::to_vec_pretty(&report).expect("serializable"),
                (false, ProfileFormat::Text) => cli::profile::render(&report).into_bytes(),
                (false, ProfileFormat::Folded) => cli::profile::folded(&report).into_bytes(),
                (false, ProfileFormat::Svg) => match cli::profile::svg(&report) {
                    Ok(b) => b,
                    Err(e) => fail(json, &e),
                },
                (false, ProfileFormat::Pprof) => cli::profile::pprof(&report),
            };
            match output {
                Some(path) => {
                    if let Err(source) = std::fs::write(&path, &body) {
                        fail(json, &CliError::Write { path, source });
                    }
                }
                None => {
                    use std::io::Write;
                    let mut out = std::io::stdout().lock();
                    if out.write_all(&body).and_then(|()| out.flush()).is_err() {
                        std::process::exit(0);
                    }
                }
            }
        }
        Verb::Threads { socket, json } => match cli::threads::run(&socket.unwrap_or_else(default_socket)) {
            Ok(t) => print(json, &t, |t: &Vec<_>| cli::threads::render(t)),
            Err(e) => fail(json, &e),
        },
        Verb::Doctor { socket, json } => {
            let r = cli::doctor::run(&socket.unwrap_or_else(default_socket));
            print(json, &r, cli::doctor::render);
            std::process::exit(if r.failed() { 1 } else { 0 });
        }
        Verb::Rules { verb: RulesVerb::List { socket, json } } => {
            match cli::rules::list(&socket.unwrap_or_else(default_socket)) {
                Ok(l) => print(json, &l, cli::rules::render_list),
                Err(e) => fail(json, &e),
            }
        }
        Verb::Rules {
            verb:
                RulesVerb::Add {
                    name,
                    keyspace,
                    cgroup,
                    cgroup_prefix,
                    tgid,
                    uid,
                    exe,
                    comm_prefix,
                    thread_name_prefix,
                    cap_in_place,
                    position,
                    socket,
                    json,
                },
        } => {
            let rule = keyspace_governor::config::RawRule {
                name,
                keyspace,
                cgroup,
                cgroup_prefix,
                tgid,
                uid,
                exe,
                comm_prefix,
                thread_name_prefix,
                cap_in_place,
            };
            match cli::rules::add(&socket.unwrap_or_else(default_socket), &rule, position) {
                Ok(mut a) => {
                    a.warnings = cli::config_cmd::rule_notices(
                        &rule.name,
                        rule.exe.as_deref(),
                        rule.cgroup.as_deref(),
                        rule.uid,
                    );
                    for w in &a.warnings {
                        eprintln!("warning: {w}");
                    }
                    print(json, &a, cli::config_cmd::render_applied)
                }
                Err(e) => fail(json, &e),
            }
        }
        Verb::Rules { verb: RulesVerb::Remove { name, socket, json } } => {
            match cli::rules::remove(&socket.unwrap_or_else(default_socket), &name) {
                Ok(a) => print(json, &a, cli::config_cmd::render_applied),
                Err(e) => fail(json, &e),
            }
        }
        Verb::Config { verb: ConfigVerb::Validate { file, json } } => match cli::config_cmd::validate(&file) {
            Ok(c) => {
                let warnings = cli::config_cmd::notices(&c);
                for notice in &warnings {
                    eprintln!("warning: {notice}");
                }
                // One shape with the refusal's: `valid`, `path`, then what
                // a valid file holds.
                let body = serde_json::json!({
                    "valid": true, "path": file, "warnings": warnings, "config": &c,
                });
                print(json, &body, |_| c.to_toml_string())
            }
            Err(e) => fail(json, &e),
        },
        Verb::Config { verb: ConfigVerb::Show { file: None, socket: Some(socket), json } } => {
            match cli::config_cmd::show_running(&socket) {
                Ok(r) => print(json, &r, cli::config_cmd::render_running),
                Err(e) => fail(json, &e),
            }
        }
        Verb::Config { verb: ConfigVerb::Show { file, json, .. } } => match cli::config_cmd::show(file.as_deref()) {
            Ok(c) => print(json, &c, |c| c.to_toml_string()),
            Err(e) => fail(json, &e),
        },
        Verb::Config { verb: ConfigVerb::Set { assignment, socket, json } } => {
            match cli::config_cmd::set(&socket.unwrap_or_else(default_socket), &assignment) {
                // Say why nothing changed: the value (100MB, say) is the one
                // in force (100MiB).
                Ok(a) if a.changes.is_empty() => print(json, &a, |_| {
                    let key = assignment.split_once('=').map_or(assignment.as_str(), |(k, _)| k.trim());
                    format!("accepted; nothing changed: {key} is that value already\n")
                }),
                Ok(a) => print(json, &a, cli::config_cmd::render_applied),
                Err(e) => fail(json, &e),
            }
        }
        Verb::Config { verb: ConfigVerb::Reload { socket, json } } => {
            match cli::config_cmd::reload(&socket.unwrap_or_else(default_socket)) {
                Ok(a) => print(json, &a, cli::config_cmd::render_applied),
                Err(e) => fail(json, &e),
            }
        }
    }
}

/// An agent started with `--json` that cannot run: its reason as one more
/// JSON log line on stderr (with the exit code; whatever the log filter),
/// then the exit.
fn agent_fatal(message: String, code: i32) -> ! {
    eprintln!("{}", serde_json::json!({"level": "ERROR", "target": "governor", "message": message, "exit_code": code}));
    std::process::exit(code)
}

fn init_logging(json: bool) {
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    if json {
        b.format(|f, r| {
            use std::io::Write;
            writeln!(
                f,
                "{}",
                serde_json::json!({"level": r.level().as_str(), "target": r.target(), "message": r.args().to_string()})
            )
        });
    }
    b.init();
}

fn run_agent(
    cfg: ValidatedConfig,
    config_path: Option<PathBuf>,
    measure: Option<MeasureMode>,
    socket: Option<PathBuf>,
    metrics_addr: Option<std::net::SocketAddr>,
) -> Result<(), keyspace_governor::agent::AgentError> {
    let mut opts = keyspace_governor::agent::AgentOptions::from_config(&cfg);
    // An absolute path: reloads read the same file whatever the cwd.
    opts.config_path = config_path.map(|p| std::fs::canonicalize(&p).unwrap_or(p));
    if let Some(a) = metrics_addr {
        opts.metrics_addr = a;
    }
    if let Some(m) = measure {
        opts.measure = m;
    }
    if let Some(s) = socket {
        // Absolute, as the configuration's `control-socket` must be.
        opts.socket = std::path::absolute(&s).unwrap_or(s);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(keyspace_governor::agent::AgentError::Runtime)?;
    rt.block_on(async {
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
            log::info!("shutting down");
        };
        keyspace_governor::agent::run(opts, shutdown).await
    })
}
