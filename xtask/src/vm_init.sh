#!/bin/busybox sh
# /init of the `cargo xtask vm-test` guest: mounts what the agent needs, on a
# pure cgroup2 hierarchy, runs the agent and the kernel tests, prints
# VM-TEST-EXIT=<code> (the first failing step's code, 0 when all pass) and
# powers the VM off.
/bin/busybox --install -s /bin
export PATH=/opt/governor:/bin LD_LIBRARY_PATH=/lib HOME=/root TMPDIR=/tmp RUST_BACKTRACE=1

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t bpf bpf /sys/fs/bpf
mount -t debugfs debugfs /sys/kernel/debug
mount -t tracefs tracefs /sys/kernel/tracing
mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo +cpu >/sys/fs/cgroup/cgroup.subtree_control
ip link set lo up
hostname vm-test

echo "VM-TEST-INIT kernel $(uname -r) $(uname -m), $(nproc) CPUs, $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)," \
    "clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)," \
    "cgroup2 controllers: $(cat /sys/fs/cgroup/cgroup.controllers)"

status=0
uptime_s() { cut -d' ' -f1 /proc/uptime; }
# A heartbeat the host reads: a guest whose kernel stops (as an emulated
# x86 guest's rarely does) falls silent, while a test that hangs does not.
(while sleep 10; do echo VM-TEST-ALIVE; done) &

# step NAME COMMAND...: runs it, prints its code and time, keeps the first
# failure. vm_test_only=NAME,NAME on the kernel command line (`cargo xtask
# vm-test --only`) runs only those steps.
step() {
    name=$1
    shift
    case ",${vm_test_only:-$name}," in *",$name,"*) ;; *) return ;; esac
    echo "VM-TEST-STEP $name: $*"
    t0=$(uptime_s)
    "$@"
    rc=$?
    echo "VM-TEST-STEP $name rc=$rc seconds=$(awk -v a="$t0" -v b="$(uptime_s)" 'BEGIN {printf "%.1f", b - a}')"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

# The agent as an operator starts it (--measure auto): it must come up on the
# eBPF backend, not on the fallback. Its log says why if it falls back.
agent_backend() {
    sock=/run/governor/governor.sock
    mkdir -p /run/governor
    governor agent --measure auto --socket "$sock" --metrics-addr 127.0.0.1:0 2>/tmp/agent.log &
    pid=$!
    i=0
    until governor status --socket "$sock" --json >/tmp/status.json 2>/dev/null; do
        i=$((i + 1))
        if [ "$i" -ge 600 ] || ! kill -0 "$pid" 2>/dev/null; then
            echo "the agent did not answer:"
            cat /tmp/agent.log
            kill "$pid" 2>/dev/null
            return 1
        fi
        sleep 0.1
    done
    governor status --socket "$sock"
    kill "$pid"
    wait "$pid"
    cat /tmp/agent.log
    grep -q '"backend": *"ebpf"' /tmp/status.json
}

# The readers' enforcement on cgroup v2: an unmodified burner (two threads)
# matched by rule and capped at 0.5 core is moved into the agent's
# <prefix>-ks-<id> cgroup at the top of the hierarchy with cpu.max
# "125000 250000" (the default period), held to its cap (by the agent's
# charge and by schedstat, over 10 s, within 5 %), and the cgroup is gone
# after the agent stops.
# start_agent NAME: the agent on the eBPF backend with /tmp/NAME.toml, on
# /run/governor/NAME.sock ($sock), its pid in $agent, its log in
# /tmp/NAME-agent.log; fails (printing the log) if it does not answer.
start_agent() {
    sock=/run/governor/$1.sock
    mkdir -p /run/governor
    governor agent --measure ebpf --config /tmp/"$1".toml --socket "$sock" --metrics-addr 127.0.0.1:0 2>/tmp/"$1"-agent.log &
    agent=$!
    i=0
    until governor status --socket "$sock" >/dev/null 2>&1; do
        i=$((i + 1))
        if [ "$i" -ge 600 ]; then cat /tmp/"$1"-agent.log; return 1; fi
        sleep 0.1
    done
}
ks_seconds() {
    governor keyspace 960 --socket "$1" --json | sed -n 's/.*"cpu_seconds": *\([0-9.e+-]*\).*/\1/p' | head -n 1
}
schedstat_sum() {
    cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%.6f", s / 1e9}'
}
# stop_wait PID: SIGSTOP, then waits until every thread of PID has stopped
# (switched out: its schedstat and its charges hold still), at most 10 s.
stop_wait() {
    kill -STOP "$1"
    i=0
    while grep -qv '^[0-9]* ([^)]*) [TtZX] ' /proc/"$1"/task/*/stat 2>/dev/null; do
        i=$((i + 1))
        if [ "$i" -ge 1000 ]; then echo "$1 did not stop"; return 1; fi
        sleep 0.01
    done
}
throttled() {
    sed -n 's/^nr_throttled //p' /sys/fs/cgroup"$1"/cpu.stat
}
cgroup_v2() {
    printf '[resource-control.cpu-throttle]\nenabled = true\nkeyspace-cpu-quotas = "960:500"\n\n[[rules]]\nname = "burner"\nkeyspace = 960\ncomm-prefix = "workload"\n' >/tmp/cgroup.toml
    start_agent cgroup || return 1
    ./workload burn --threads 2 --seconds 16 >/dev/null &
    burner=$!
    i=0
    until sed -n 's/^0:://p' /proc/"$burner"/cgroup | grep -q -- '-ks-960$'; do
        i=$((i + 1))
        if [ "$i" -ge 2000 ]; then break; fi
        sleep 0.01
    done
    cg=$(sed -n 's/^0:://p' /proc/"$burner"/cgroup)
    cg_max=$(cat /sys/fs/cgroup"$cg"/cpu.max 2>/dev/null)
    echo "burner $burner in $cg, cpu.max $cg_max"
    # Read while the burner is stopped: both counts cover the same 10 s
    # (cpu.max may hand out one more period's quota at either edge: 4.2 %
    # of 3 s at 250 ms, too close to the bound).
    stop_wait "$burner" || return 1
    cg_a=$(ks_seconds "$sock"); cg_sa=$(schedstat_sum "$burner"); cg_na=$(throttled "$cg")
    cg_t0=$(uptime_s); kill -CONT "$burner"
    sleep 10
    kill -STOP "$burner"; cg_t1=$(uptime_s); stop_wait "$burner" || return 1
    cg_b=$(ks_seconds "$sock"); cg_sb=$(schedstat_sum "$burner"); cg_nb=$(throttled "$cg")
    kill -KILL "$burner" 2>/dev/null
    wait "$burner" 2>/dev/null
    kill "$agent"
    wait "$agent"
    cg_left=$(ls -d /sys/fs/cgroup/governor*ks-* 2>/dev/null)
    awk -v a="$cg_a" -v b="$cg_b" -v sa="$cg_sa" -v sb="$cg_sb" -v t0="$cg_t0" -v t1="$cg_t1" -v cg="$cg" -v max="$cg_max" -v left="$cg_left" \
        -v na="$cg_na" -v nb="$cg_nb" 'BEGIN {
        agent = (b - a) / (t1 - t0); kernel = (sb - sa) / (t1 - t0)
        printf "cgroup v2 cap 0.5 core: agent %.3f cores, schedstat %.3f cores over %.1f s, throttled %d times\n", agent, kernel, t1 - t0, nb - na
        ok = cg ~ /^\/[^\/]*-ks-960$/ && max == "125000 250000" && left == ""
        # Held back by its cap (throttled), so within 5 % of it both ways.
        ok = ok && nb > na && agent >= 0.475 && agent <= 0.525 && kernel >= 0.475 && kernel <= 0.525
        if (!ok) { printf "FAILED: cgroup %s, cpu.max %s, left behind %s\n", cg, max, left; exit 1 }
    }' || { cat /tmp/cgroup-agent.log; return 1; }
}

# The ticket API, smoke: an agent with a uniform tenant cap of 0.25 of the
# node (0.5 core on 2 vCPUs); two worker threads take a ticket per 1 ms of
# work for 3 s. Tickets are granted and some wait, none is admitted
# fail-open, the keyspace is charged at least the work the workers' thread
# clocks counted inside their tickets and at most all their CPU, as much as
# the tickets say they consumed (within 2 %), and it is held to its cap
# over the workers' loop (the time the workload itself reports).
tickets_smoke() {
    printf '[resource-control]\nmax-read-cpu-ratio = 0.6\n[resource-control.cpu-throttle]\nenabled = true\nenforce-global-limit = true\ntenant-max-cpu-ratio = 0.25\nenable-burst = false\nenable-fair-allocation = false\nenable-dynamic-adjustment = false\n' >/tmp/tickets.toml
    start_agent tickets || return 1
    tk_out=$(./workload tickets --socket "$sock" --keyspace 5 --threads 2 --seconds 3 --work-us 1000 | tail -n 1)
    tk_json=$(governor keyspace 5 --socket "$sock" --json)
    kill "$agent"
    wait "$agent"
    echo "tickets: $tk_out"
    tk_field() { echo "$1" | sed -n "s/.*\"$2\": *\([0-9.e+-]*\).*/\1/p" | head -n 1; }
    awk -v granted="$(tk_field "$tk_out" granted)" -v fail_open="$(tk_field "$tk_out" fail_open)" \
        -v work_ns="$(tk_field "$tk_out" work_cpu_ns)" -v all_ns="$(tk_field "$tk_out" thread_cpu_ns)" \
        -v consumed_ns="$(tk_field "$tk_out" ticket_consumed_ns)" -v charged="$(tk_field "$tk_json" cpu_seconds)" \
        -v waited="$(tk_field "$tk_json" waited)" -v loop="$(tk_field "$tk_out" loop_seconds)" 'BEGIN {
        cores = charged / loop; work = work_ns / 1e9; all = all_ns / 1e9; consumed = consumed_ns / 1e9
        printf "tickets: %d granted, %d waited, %d fail-open; keyspace charged %.3f s, tickets consumed %.3f s, work inside them %.3f s, workers in all %.3f s; %.3f cores against a 0.5 cap\n", granted, waited, fail_open, charged, consumed, work, all, cores
        ok = granted > 100 && waited > 0 && fail_open == 0
        ok = ok && charged >= 0.99 * work && charged <= 1.01 * all
        ok = ok && charged >= 0.98 * consumed && charged <= 1.02 * consumed && cores <= 0.55 && cores >= 0.3
        if (!ok) { print "FAILED"; exit 1 }
    }' || { cat /tmp/tickets-agent.log; return 1; }
}

# The caps are fractions of the server's cgroup (cgroup v2 here): a server
# in a cgroup with cpu.max "100000 100000" (1 core), a tenant cap of 0.4:
# status names the cgroup's cpu.max and 1 core, the tenant's bucket refills
# 0.4 core, and by the workers' own thread clocks (the kernel's books) the
# tickets consumed about 0.4 core and the workers ran far below the 0.8
# that 0.4 of the 2 vCPUs would give.
server_cpu_v2() {
    printf '[resource-control]\nmax-read-cpu-ratio = 0.6\n[resource-control.cpu-throttle]\nprofile = "essential"\ntenant-max-cpu-ratio = 0.4\n' >/tmp/servercpu.toml
    start_agent servercpu || return 1
    echo +cpu >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
    mkdir -p /sys/fs/cgroup/server-1core
    echo "100000 100000" >/sys/fs/cgroup/server-1core/cpu.max || return 1
    sh -c "echo \$\$ > /sys/fs/cgroup/server-1core/cgroup.procs && exec ./workload tickets --socket $sock --keyspace 5 --threads 4 --seconds 6 --work-us 1000" >/tmp/servercpu.out &
    srv=$!
    sleep 4
    sc_json=$(governor status --socket "$sock" --json | tr -d '\n ')
    sc_ks=$(governor keyspace 5 --socket "$sock" --json | tr -d '\n ')
    wait "$srv"
    sc_out=$(tail -n 1 /tmp/servercpu.out)
    sc_charged=$(governor keyspace 5 --socket "$sock" --json | tr -d '\n ' | sed -n 's/.*"cpu_seconds":\([0-9.e-]*\).*/\1/p')
    kill "$agent"
    wait "$agent"
    rmdir /sys/fs/cgroup/server-1core
    sc_field() { echo "$1" | sed -n "s/.*\"$2\": *\([^,}]*\).*/\1/p" | head -n 1; }
    sc_cpu=$(echo "$sc_json" | sed -n 's/.*"server_cpu":{"cores":\([0-9.]*\),"source":"\([a-z-]*\)","detail":"\([^"]*\)".*/\1 \2 \3/p')
    sc_refill=$(echo "$sc_ks" | sed -n 's/.*"refill_us":\([0-9]*\).*/\1/p')
    echo "server CPU: $sc_cpu; tenant refill $sc_refill us; workload: $sc_out"
    echo "$sc_cpu" | grep -q '^1.0 cpu-quota /sys/fs/cgroup/server-1core/cpu.max' || { echo FAILED; cat /tmp/servercpu-agent.log; return 1; }
    awk -v refill="$sc_refill" -v charged="$sc_charged" -v all_ns="$(sc_field "$sc_out" thread_cpu_ns)" -v loop="$(sc_field "$sc_out" loop_seconds)" \
        -v consumed_ns="$(sc_field "$sc_out" ticket_consumed_ns)" 'BEGIN {
        cores = consumed_ns / 1e9 / loop; all = all_ns / 1e9 / loop; kernel = charged / loop
        printf "server in a 1-core cgroup, tenant cap 0.4: the kernel counted %.3f cores of the keyspace (charged), tickets consumed %.3f, workers ran %.3f in all (their CLOCK_THREAD_CPUTIME_ID, as schedstat)\n", kernel, cores, all
        # The cap of the server'"'"'s 1 core, not of the VM'"'"'s 2: the kernel'"'"'s count
        # of the keyspace and its tickets within 5 %; the workers'"'"' own count adds
        # the runtime between tickets, untagged (6 % under emulation).
        ok = refill == 4000 && kernel >= 0.38 && kernel <= 0.42 && cores >= 0.38 && cores <= 0.42 && all <= 0.46
        if (!ok) { print "FAILED"; exit 1 }
    }' || { cat /tmp/servercpu-agent.log; return 1; }
}

cd /opt/governor || exit 1
step doctor governor doctor
step agent-backend agent_backend
# The two tests that drop privileges need util-linux's setpriv (--reuid),
# which busybox lacks; the host run covers them.
step measurement ./measurement --test-threads 1 --nocapture --skip without_capabilities
step kernel_exact ./kernel_exact --test-threads 1 --nocapture
step client_api ./client_api --test-threads 1 --nocapture
step cgroup-v2 cgroup_v2
step tickets tickets_smoke
step server-cpu server_cpu_v2
# Run-queue wait per keyspace against schedstat (sched_info at this
# kernel's offsets, on this architecture), whom the waits were behind, and
# the CPU pressure (the wakeup program on this kernel; no count left open
# by threads that switch keyspaces).
step cpu-wait env GOVERNOR_TEST_EMULATED=1 ./cpu_wait --test-threads 1 --nocapture --exact \
    each_keyspace_is_charged_its_threads_run_queue_wait_as_schedstat_counts_it \
    a_keyspaces_waits_name_whom_they_were_behind \
    a_keyspaces_cpu_pressure_is_the_time_one_of_its_threads_waited \
    pressure_of_threads_switching_keyspaces_ends_where_it_began_and_closes
# What CI runs on every kernel and architecture (only when named in --only):
# exactly-once attribution on the eBPF backend and the long slice.
case ",${vm_test_only:-}," in
*",core,"*) step core ./measurement --test-threads 1 --nocapture --exact \
    ebpf_charges_every_nanosecond_exactly_once long_slice_is_charged_while_it_runs ;;
esac
# Per-keyspace profiles: the perf_event program, stacks and symbols on this
# kernel and architecture.
case ",${vm_test_only:-}," in
*",profile,"*) step profile env GOVERNOR_TEST_EMULATED=1 ./profile --test-threads 1 --nocapture --exact \
    keyspaces_on_the_same_threads_get_their_own_stacks_in_proportion_to_their_cpu \
    request_kinds_of_one_keyspace_get_their_own_stacks ;;
esac

if [ "$status" -ne 0 ]; then
    echo "last kernel messages:"
    dmesg | tail -n 20
fi
echo "VM-TEST-EXIT=$status"
sync
poweroff -f
